//! The kernel sources of `kernels/*.cu`, embedded in the binary.
//!
//! Each source is compiled by NVRTC as `common.cuh` followed by the file, so
//! a deployed binary needs neither the source tree nor CUDA headers. The list
//! below is the single registry of kernel files and their entry points; a test
//! checks it against the directory so a new `.cu` file cannot be forgotten.

/// Helpers prepended to every kernel source.
pub const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// One `kernels/*.cu` file and the `extern "C"` entry points it defines.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// File name under `kernels/`.
    pub file: &'static str,
    pub source: &'static str,
    pub functions: &'static [&'static str],
}

impl KernelSource {
    /// The text handed to NVRTC: the common helpers, then the file (with a
    /// `#line` so compiler messages point into the right file).
    pub fn full_source(&self) -> String {
        format!(
            "#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"{}\"\n{}",
            self.file, self.source
        )
    }
}

macro_rules! kernel {
    ($file:literal, [$($f:literal),* $(,)?]) => {
        KernelSource {
            file: $file,
            source: include_str!(concat!("../../../kernels/", $file)),
            functions: &[$($f),*],
        }
    };
}

/// Every kernel file, in dependency-free order.
pub const SOURCES: &[KernelSource] = &[
    kernel!("embedding.cu", ["embed_gather"]),
    kernel!(
        "rmsnorm.cu",
        [
            "add_rms_norm",
            "add_rms_norm_q8",
            "rms_norm_f32",
            "add_layer_norm"
        ]
    ),
    kernel!("rope.cu", ["add_bias", "add_f32"]),
    kernel!("rope_kv.cu", ["rope_kv_append"]),
    kernel!("attention.cu", ["paged_attention", "paged_attention_merge"]),
    kernel!("prefill_attention.cu", ["prefill_attention"]),
    kernel!("penalty.cu", ["count_tokens"]),
    kernel!(
        "verify.cu",
        ["verify_inputs", "draft_counts", "accept_drafts"]
    ),
    kernel!(
        "swiglu.cu",
        [
            "swiglu",
            "swiglu_q8",
            "gelu_mul",
            "gelu_mul_q8",
            "bias_gelu"
        ]
    ),
    kernel!("gemma.cu", ["scale_f32", "softcap"]),
    kernel!(
        "region.cu",
        [
            "spatial_values",
            "fourier_features",
            "spatial_embed",
            "hidden_f16",
            "accept_values"
        ]
    ),
    kernel!(
        "quant.cu",
        [
            "mmvq_q4_0_r1",
            "mmvq_q4_0_r2",
            "mmvq_q4_0_r4",
            "mmvq_q4_0_r8",
            "mmvq_q4_0_r16",
            "mmvq_q4_1_r1",
            "mmvq_q4_1_r2",
            "mmvq_q4_1_r4",
            "mmvq_q4_1_r8",
            "mmvq_q4_1_r16",
            "mmvq_q5_0_r1",
            "mmvq_q5_0_r2",
            "mmvq_q5_0_r4",
            "mmvq_q5_0_r8",
            "mmvq_q5_0_r16",
            "mmvq_q5_1_r1",
            "mmvq_q5_1_r2",
            "mmvq_q5_1_r4",
            "mmvq_q5_1_r8",
            "mmvq_q5_1_r16",
            "mmvq_q8_0_r1",
            "mmvq_q8_0_r2",
            "mmvq_q8_0_r4",
            "mmvq_q8_0_r8",
            "mmvq_q8_0_r16",
            "mmvq_q4_k_r1",
            "mmvq_q4_k_r2",
            "mmvq_q4_k_r4",
            "mmvq_q4_k_r8",
            "mmvq_q4_k_r16",
            "mmvq_q5_k_r1",
            "mmvq_q5_k_r2",
            "mmvq_q5_k_r4",
            "mmvq_q5_k_r8",
            "mmvq_q5_k_r16",
            "mmvq_q6_k_r1",
            "mmvq_q6_k_r2",
            "mmvq_q6_k_r4",
            "mmvq_q6_k_r8",
            "mmvq_q6_k_r16",
            "quantize_q8_h",
            "dequant_f16",
            "embed_gather_q",
        ]
    ),
    kernel!("sample.cu", ["sample_rows", "reset_counts"]),
];

/// The block size `CudaDevice` launches each entry point with (keep in
/// step with `runtime/cuda.rs`): `tests/nvrtc.rs` holds each kernel's
/// registers, as the device's assembler allocates them, within what such a
/// block can have (65,536 per block, in units of 8 per thread).
pub const BLOCK_THREADS: &[(&str, u32)] = &[
    ("embed_gather", 256),
    ("add_rms_norm", NORM_BLOCK),
    ("add_rms_norm_q8", NORM_BLOCK),
    ("rms_norm_f32", NORM_BLOCK),
    ("add_layer_norm", NORM_BLOCK),
    ("add_bias", 256),
    ("add_f32", 256),
    ("rope_kv_append", 128),
    ("paged_attention", ATTENTION_THREADS),
    ("paged_attention_merge", ATTENTION_THREADS),
    ("prefill_attention", PREFILL_THREADS),
    ("count_tokens", 128),
    ("verify_inputs", 32),
    ("draft_counts", 256),
    ("accept_drafts", 64),
    ("swiglu", 256),
    ("swiglu_q8", 256),
    ("gelu_mul", 256),
    ("gelu_mul_q8", 256),
    ("bias_gelu", 256),
    ("spatial_values", SPATIAL_THREADS),
    ("fourier_features", 256),
    ("spatial_embed", 256),
    ("hidden_f16", 256),
    ("accept_values", 64),
    ("scale_f32", 256),
    ("softcap", 256),
    ("mmvq_q4_0_r1", MMVQ_WARPS * 32),
    ("mmvq_q4_0_r2", MMVQ_WARPS * 32),
    ("mmvq_q4_0_r4", MMVQ_WARPS * 32),
    ("mmvq_q4_0_r8", MMVQ_WARPS * 32),
    ("mmvq_q4_0_r16", MMVQ_WARPS * 32),
    ("mmvq_q4_1_r1", MMVQ_WARPS * 32),
    ("mmvq_q4_1_r2", MMVQ_WARPS * 32),
    ("mmvq_q4_1_r4", MMVQ_WARPS * 32),
    ("mmvq_q4_1_r8", MMVQ_WARPS * 32),
    ("mmvq_q4_1_r16", MMVQ_WARPS * 32),
    ("mmvq_q5_0_r1", MMVQ_WARPS * 32),
    ("mmvq_q5_0_r2", MMVQ_WARPS * 32),
    ("mmvq_q5_0_r4", MMVQ_WARPS * 32),
    ("mmvq_q5_0_r8", MMVQ_WARPS * 32),
    ("mmvq_q5_0_r16", MMVQ_WARPS * 32),
    ("mmvq_q5_1_r1", MMVQ_WARPS * 32),
    ("mmvq_q5_1_r2", MMVQ_WARPS * 32),
    ("mmvq_q5_1_r4", MMVQ_WARPS * 32),
    ("mmvq_q5_1_r8", MMVQ_WARPS * 32),
    ("mmvq_q5_1_r16", MMVQ_WARPS * 32),
    ("mmvq_q8_0_r1", MMVQ_WARPS * 32),
    ("mmvq_q8_0_r2", MMVQ_WARPS * 32),
    ("mmvq_q8_0_r4", MMVQ_WARPS * 32),
    ("mmvq_q8_0_r8", MMVQ_WARPS * 32),
    ("mmvq_q8_0_r16", MMVQ_WARPS * 32),
    ("mmvq_q4_k_r1", MMVQ_WARPS * 32),
    ("mmvq_q4_k_r2", MMVQ_WARPS * 32),
    ("mmvq_q4_k_r4", MMVQ_WARPS * 32),
    ("mmvq_q4_k_r8", MMVQ_WARPS * 32),
    ("mmvq_q4_k_r16", MMVQ_WARPS * 32),
    ("mmvq_q5_k_r1", MMVQ_WARPS * 32),
    ("mmvq_q5_k_r2", MMVQ_WARPS * 32),
    ("mmvq_q5_k_r4", MMVQ_WARPS * 32),
    ("mmvq_q5_k_r8", MMVQ_WARPS * 32),
    ("mmvq_q5_k_r16", MMVQ_WARPS * 32),
    ("mmvq_q6_k_r1", MMVQ_WARPS * 32),
    ("mmvq_q6_k_r2", MMVQ_WARPS * 32),
    ("mmvq_q6_k_r4", MMVQ_WARPS * 32),
    ("mmvq_q6_k_r8", MMVQ_WARPS * 32),
    ("mmvq_q6_k_r16", MMVQ_WARPS * 32),
    ("quantize_q8_h", 256),
    ("dequant_f16", 256),
    ("embed_gather_q", 256),
    ("sample_rows", SAMPLE_THREADS),
    ("reset_counts", 256),
];

const NORM_BLOCK: u32 = crate::reference::NORM_THREADS as u32;

/// Threads per block of `sample_rows` (its scan buffer is sized for this).
pub const SAMPLE_THREADS: u32 = 1024;
/// Threads per block of `paged_attention` (its shared arrays are sized
/// for this) and `paged_attention_merge`.
pub const ATTENTION_THREADS: u32 = crate::reference::ATT_THREADS as u32;
/// Query heads of a GQA group one `paged_attention` block serves.
pub const ATTENTION_HEADS_PER_BLOCK: usize = crate::reference::ATT_HB;
/// Most key ranges one decode row's attention is split into (a block
/// each): 32 blocks a KV head at long contexts, so 8 KV heads fill an
/// H100's 132 SMs at one row. Chosen by SM count, not measured.
pub const ATTENTION_MAX_SPLITS: usize = 32;
/// Query rows per block of `prefill_attention` (its shared Q tile).
pub const PREFILL_Q_ROWS: usize = 8;
/// Threads per block of `prefill_attention` (two rows per warp).
pub const PREFILL_THREADS: u32 = 128;
/// Most activation rows one `mmvq_*` launch takes (its accumulators).
pub const MMVQ_MAX_ROWS: usize = 16;
/// Warps per block of `mmvq_*` (one block per weight row; the warps split
/// its weight blocks and meet in shared memory).
pub const MMVQ_WARPS: u32 = 4;
/// Threads per block of `spatial_values` (one block per row; its shared
/// argmax arrays are this long).
pub const SPATIAL_THREADS: u32 = 256;
/// Largest head dimension `paged_attention` handles (8 values per lane).
pub const MAX_HEAD_DIM: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cu_file_is_registered_and_every_entry_point_exists() {
        // The build's checkout, or (a test binary carried to another machine
        // and run from the crate's directory, as cargo does) the one here.
        let dir = [
            concat!(env!("CARGO_MANIFEST_DIR"), "/../../kernels"),
            "../../kernels",
        ]
        .into_iter()
        .find(|d| std::path::Path::new(d).is_dir())
        .expect("kernels/ exists");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .expect("kernels/ exists")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".cu"))
            .collect();
        on_disk.sort();
        let mut registered: Vec<String> = SOURCES.iter().map(|k| k.file.to_owned()).collect();
        registered.sort();
        assert_eq!(on_disk, registered);
        for k in SOURCES {
            for f in k.functions {
                let defined = k.source.contains(&format!("__global__ void {f}("))
                    || k.source.contains(&format!(") {f}("));
                assert!(defined, "{} lacks {f}", k.file);
                assert!(k.source.contains("extern \"C\""), "{}", k.file);
            }
        }
    }

    /// The launch sizes used here size shared arrays in the kernels: a drift
    /// would overflow them or fail the launch on a GPU only.
    #[test]
    fn every_entry_point_has_one_launch_block_size() {
        let mut entries: Vec<&str> = SOURCES
            .iter()
            .flat_map(|k| k.functions.iter().copied())
            .collect();
        let mut sized: Vec<&str> = BLOCK_THREADS.iter().map(|(n, _)| *n).collect();
        entries.sort_unstable();
        sized.sort_unstable();
        assert_eq!(entries, sized);
        assert!(BLOCK_THREADS.iter().all(|(_, t)| t % 32 == 0 && *t <= 1024));
    }

    #[test]
    fn launch_constants_match_the_kernels_defines() {
        let src = |file: &str| SOURCES.iter().find(|k| k.file == file).expect(file).source;
        assert!(src("sample.cu").contains(&format!("#define SAMPLE_THREADS {SAMPLE_THREADS}\n")));
        let att = src("attention.cu");
        assert!(att.contains(&format!("#define ATT_THREADS {ATTENTION_THREADS}\n")));
        assert!(att.contains(&format!("#define ATT_HB {ATTENTION_HEADS_PER_BLOCK} ")));
        // 8 dimensions a lane, 32 lanes a key at most.
        assert!(att.contains("#define ATT_VEC 8 "));
        assert_eq!(MAX_HEAD_DIM, 8 * 32);
        let pf = src("prefill_attention.cu");
        assert!(pf.contains(&format!("#define PF_Q_ROWS {PREFILL_Q_ROWS}\n")));
        assert!(pf.contains(&format!("#define PF_WARPS {}\n", PREFILL_THREADS / 32)));
        assert!(pf.contains(&format!("#define PF_MAX_HD {MAX_HEAD_DIM}\n")));
        assert!(pf.contains(&format!(
            "#define PF_KEYS {}\n",
            crate::reference::PREFILL_KEYS
        )));
        let q = src("quant.cu");
        assert!(q.contains(&format!("#define MMVQ_MAX_ROWS {MMVQ_MAX_ROWS}\n")));
        assert!(q.contains(&format!("#define MMVQ_WARPS {MMVQ_WARPS}\n")));
        assert!(src("region.cu").contains(&format!("#define SPATIAL_THREADS {SPATIAL_THREADS}\n")));
        let norm = src("rmsnorm.cu");
        assert!(norm.contains(&format!(
            "#define NORM_THREADS {}\n",
            crate::reference::NORM_THREADS
        )));
    }
}
