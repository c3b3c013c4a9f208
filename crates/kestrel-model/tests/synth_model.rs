//! Synthetic model files round trip through the loader: a small Llama shape
//! (the real presets are too big for CI; the writer is the same) with the
//! default model's tokenizer, written in every [`SynthFormat`], tied and
//! untied, read back by `kestrel_model::load`: the config (llama3 RoPE
//! factors included), llama-quantize's tensor types, every tensor's bytes
//! equal to quantizing the spec's values, the tokenizer, and (Q4_K_M) the
//! same bytes on a second write with another thread count.

use kestrel_model::synth_gguf::{tensor_dtype, MatrixRole, SynthShape};
use kestrel_model::{
    default_model_path, load, quant, write_synth_gguf, DType, GgufFile, SynthFormat, SynthSpec,
};

/// Llama 1B's RoPE and head size, cut to 3 layers of hidden 256.
fn small_spec(format: SynthFormat, tied: bool, vocab: usize) -> SynthSpec {
    let mut spec = SynthSpec::preset(SynthShape::Llama1B, format, 11, vocab);
    let c = &mut spec.config;
    c.hidden_size = 256;
    c.intermediate_size = 512;
    c.num_layers = 3;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.tie_word_embeddings = tied;
    spec
}

#[test]
fn synthetic_files_load_back_bit_exact() {
    let tok = GgufFile::open(&default_model_path().expect("fetch the default model")).unwrap();
    let vocab = tok.get_array("tokenizer.ggml.tokens").unwrap().len();
    let default = load(&default_model_path().unwrap()).unwrap();
    let dir = std::env::temp_dir().join(format!("kestrel-synth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (format, tied) in [
        (SynthFormat::Q4KM, true),
        (SynthFormat::Q4KM, false),
        (SynthFormat::Q8_0, false),
        (SynthFormat::Q4_0, true),
        (SynthFormat::F16, true),
    ] {
        let spec = small_spec(format, tied, vocab);
        let path = dir.join(format!("{}-{tied}.gguf", format.name()));
        let stats = write_synth_gguf(&spec, &tok, &path, 2).unwrap();
        let label = format!("{} tied={tied}", format.name());

        let model = load(&path).unwrap();
        assert_eq!(model.weights.config, spec.config, "{label}: config");
        assert!(model.weights.config.features.rope_freq_factors.is_some());
        assert_eq!(model.eos_token_ids, default.eos_token_ids, "{label}");
        let text = "Synthetic weights, real tokens.";
        assert_eq!(
            model.encode(text).unwrap(),
            default.encode(text).unwrap(),
            "{label}"
        );

        let g = GgufFile::open(&path).unwrap();
        let descs = spec.tensors();
        assert_eq!(g.tensors.len(), descs.len(), "{label}: tensor count");
        let mut tensor_bytes = 0;
        for (i, d) in descs.iter().enumerate() {
            let (info, dtype, bytes) = g.tensor_bytes(&d.name).unwrap();
            assert_eq!(
                (&info.dims, dtype),
                (&d.dims, d.dtype),
                "{label}: {}",
                d.name
            );
            let rows = d.dims.iter().skip(1).product::<u64>() as usize;
            let mut want = Vec::new();
            quant::quantize(d.dtype, &spec.values(i, d, 0..rows), &mut want);
            assert!(*bytes == want[..], "{label}: {} bytes differ", d.name);
            tensor_bytes += bytes.len() as u64;
        }
        assert_eq!(stats.tensor_bytes, tensor_bytes, "{label}");

        // llama-quantize's choices, as the loader sees them.
        let n = spec.config.num_layers;
        let head = if tied {
            &model.weights.token_embd
        } else {
            &model.weights.lm_head
        };
        let want_head = tensor_dtype(format, MatrixRole::Output, 0, n, tied);
        assert_eq!(head.dtype, want_head, "{label}: output head");
        for (i, l) in model.weights.layers.iter().enumerate() {
            let t = |role| tensor_dtype(format, role, i, n, tied);
            assert_eq!(l.wv.dtype, t(MatrixRole::AttnV), "{label} layer {i}");
            assert_eq!(l.w_down.dtype, t(MatrixRole::FfnDown), "{label} layer {i}");
            assert_eq!(l.wq.dtype, t(MatrixRole::AttnQ), "{label} layer {i}");
        }
        if format == SynthFormat::Q4KM {
            // 3 layers: n/8 = 0, 7n/8 = 2; layer 2 gets the extra bits.
            let kinds: Vec<DType> = model
                .weights
                .layers
                .iter()
                .map(|l| l.w_down.dtype)
                .collect();
            assert_eq!(kinds, [DType::Q4K, DType::Q4K, DType::Q6K]);
        }

        if (format, tied) == (SynthFormat::Q4KM, true) {
            let again = dir.join("again.gguf");
            write_synth_gguf(&spec, &tok, &again, 3).unwrap();
            assert!(
                std::fs::read(&again).unwrap() == std::fs::read(&path).unwrap(),
                "{label}: a second write (other thread count) differs"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_vocabulary_mismatch_is_refused() {
    let tok = GgufFile::open(&default_model_path().expect("fetch the default model")).unwrap();
    let spec = small_spec(SynthFormat::Q8_0, true, 1000);
    let path = std::env::temp_dir().join(format!("kestrel-synth-bad-{}.gguf", std::process::id()));
    let err = write_synth_gguf(&spec, &tok, &path, 1)
        .unwrap_err()
        .to_string();
    assert!(err.contains("vocab_size is 1000"), "{err}");
    assert!(!path.exists());
}
