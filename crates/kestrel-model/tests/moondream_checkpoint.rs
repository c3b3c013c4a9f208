//! Loading Moondream checkpoints written by `scripts/reference/
//! moondream_synth.py` with the published tensor names: both namings and
//! the three stored dtypes load to the same weights, and a missing tensor, a
//! wrong shape or an unsupported dtype is an error naming the tensor.
//! Skipped, saying so, without numpy unless `KESTREL_REQUIRE_PYTHON` is set.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use kestrel_model::moondream::{load_checkpoint, MoondreamConfig, MoondreamWeights, NameScheme};
use kestrel_model::{DType, ModelError};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

#[path = "../../../tests/support/reference_python.rs"]
#[allow(dead_code)]
mod reference_python;

fn synth(tag: &str, args: &[&str]) -> Option<PathBuf> {
    let python = reference_python::python_with(
        "moondream_checkpoint",
        "numpy",
        "scripts/reference/requirements.txt",
    )?;
    let dir = std::env::temp_dir().join(format!("kestrel-md-ckpt-{tag}-{}", std::process::id()));
    let out = Command::new(python)
        .arg(reference_python::repo().join("scripts/reference/moondream_synth.py"))
        .arg(&dir)
        .args(args)
        .output()
        .expect("run moondream_synth.py");
    assert!(
        out.status.success(),
        "moondream_synth.py failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(dir)
}

fn load(dir: &Path) -> Result<MoondreamWeights, ModelError> {
    let config = MoondreamConfig::from_file(&dir.join("config.json"))?;
    load_checkpoint(dir, config)
}

/// Every weight of `w` as f32, in one fixed order.
fn flatten(w: &MoondreamWeights) -> Vec<f32> {
    let mut v = Vec::new();
    let lin = |v: &mut Vec<f32>, l: &kestrel_model::moondream::Linear| {
        v.extend(l.weight.to_f32());
        v.extend(&l.bias);
    };
    lin(&mut v, &w.vision.patch_emb);
    v.extend(&w.vision.pos_emb);
    for b in &w.vision.blocks {
        for l in [&b.qkv, &b.proj, &b.mlp.fc1, &b.mlp.fc2] {
            lin(&mut v, l);
        }
        for n in [&b.ln1, &b.ln2] {
            v.extend(n.weight.iter().chain(&n.bias));
        }
    }
    lin(&mut v, &w.vision.proj.fc1);
    lin(&mut v, &w.vision.proj.fc2);
    let t = &w.text;
    v.extend(t.token_embd.to_f32());
    for b in &t.layers {
        for m in [&b.wq, &b.wk, &b.wv, &b.wo, &b.w_up, &b.w_down] {
            v.extend(m.to_f32());
        }
        for x in [
            &b.attn_norm_bias,
            &b.bq,
            &b.bk,
            &b.bv,
            &b.bo,
            &b.b_up,
            &b.b_down,
        ] {
            v.extend(x.as_ref().expect("Phi biases"));
        }
        v.extend(&b.attn_norm);
    }
    v.extend(t.lm_head.to_f32());
    v.extend(t.lm_head_bias.as_ref().expect("lm_head bias"));
    v.extend(
        t.output_norm
            .iter()
            .chain(t.output_norm_bias.as_ref().unwrap()),
    );
    let r = w.region.as_ref().expect("region weights");
    v.extend(&r.coord_features);
    v.extend(&r.size_features);
    for l in [
        &r.coord_encoder,
        &r.coord_decoder.fc1,
        &r.coord_decoder.fc2,
        &r.size_encoder,
        &r.size_decoder.fc1,
        &r.size_decoder.fc2,
    ] {
        lin(&mut v, l);
    }
    v
}

#[test]
fn both_namings_and_all_dtypes_load_the_same_weights() {
    let Some(hf) = synth("hf", &["--seed", "7"]) else {
        return;
    };
    let exported = synth("exported", &["--seed", "7", "--names", "exported"]).unwrap();
    let bf16 = synth(
        "bf16",
        &["--seed", "7", "--names", "exported", "--dtype", "BF16"],
    )
    .unwrap();
    let f16 = synth("f16", &["--seed", "7", "--dtype", "F16"]).unwrap();

    let a = load(&hf).unwrap();
    let b = load(&exported).unwrap();
    assert_eq!((a.names, b.names), (NameScheme::Hf, NameScheme::Exported));
    assert_eq!(a.vision.blocks.len(), 2);
    assert_eq!(a.vision.patch_emb.weight.dtype, DType::F32);
    assert_eq!(
        (
            a.vision.patch_emb.weight.rows,
            a.vision.patch_emb.weight.cols
        ),
        (32, 588)
    );
    assert_eq!(a.vision.pos_emb.len(), 729 * 32);
    // The exported file stores the Fourier features transposed; loaded,
    // they are the same `[inputs][feat / 2]` matrices.
    let (fa, fb) = (flatten(&a), flatten(&b));
    assert_eq!(fa, fb);

    let c = load(&bf16).unwrap();
    assert_eq!(c.vision.blocks[0].qkv.weight.dtype, DType::BF16);
    let d = load(&f16).unwrap();
    assert_eq!(d.text.token_embd.dtype, DType::F16);
    for (other, tol) in [(flatten(&c), 1.0 / 128.0), (flatten(&d), 1.0 / 1024.0)] {
        for (x, y) in fa.iter().zip(&other) {
            assert!(
                (x - y).abs() <= tol * x.abs().max(1e-3),
                "{x} stored as {y}"
            );
        }
    }
    let no_region = synth("noregion", &["--seed", "7", "--no-region"]).unwrap();
    assert!(load(&no_region).unwrap().region.is_none());
    for dir in [hf, exported, bf16, f16, no_region] {
        std::fs::remove_dir_all(dir).ok();
    }
}

/// Rewrites `dir`'s checkpoint with `edit` applied to its (name, dtype,
/// shape, bytes) list.
fn rewrite(dir: &Path, edit: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>)) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut list: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    edit(&mut list);
    let views: HashMap<String, TensorView<'_>> = list
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(&path, safetensors::serialize(&views, None).unwrap()).unwrap();
}

#[test]
fn broken_checkpoints_name_the_tensor() {
    let Some(dir) = synth("broken", &["--seed", "3"]) else {
        return;
    };
    let missing = "model.text.blocks.1.mlp.fc2.bias";
    rewrite(&dir, |l| l.retain(|t| t.0 != missing));
    match load(&dir) {
        Err(ModelError::MissingTensor { tensor }) => assert!(tensor.starts_with(missing)),
        other => panic!("{other:?}"),
    }

    std::fs::remove_dir_all(&dir).ok();
    let dir = synth("broken2", &["--seed", "3"]).unwrap();
    let wrong = "model.vision.blocks.0.attn.qkv.weight";
    rewrite(&dir, |l| {
        let t = l.iter_mut().find(|t| t.0 == wrong).unwrap();
        t.2 = vec![48, 64];
    });
    match load(&dir) {
        Err(ModelError::ShapeMismatch {
            tensor,
            expected,
            found,
        }) => {
            assert_eq!(tensor, wrong);
            assert_eq!((expected, found), (vec![96, 32], vec![48, 64]));
        }
        other => panic!("{other:?}"),
    }

    let dir2 = synth("broken3", &["--seed", "3"]).unwrap();
    let ints = "model.vision.post_ln.bias";
    rewrite(&dir2, |l| {
        let t = l.iter_mut().find(|t| t.0 == ints).unwrap();
        t.1 = Dtype::I32;
    });
    match load(&dir2) {
        Err(ModelError::UnsupportedSafetensorsDtype { tensor, .. }) => assert_eq!(tensor, ints),
        other => panic!("{other:?}"),
    }

    // A text-only (or unrelated) checkpoint: no vision tower at all.
    let dir3 = synth("broken4", &["--seed", "3"]).unwrap();
    rewrite(&dir3, |l| l.retain(|t| !t.0.starts_with("model.vision.")));
    assert!(matches!(load(&dir3), Err(ModelError::MissingTensor { .. })));
    for d in [dir, dir2, dir3] {
        std::fs::remove_dir_all(d).ok();
    }
}

/// `kestrel_model::load` of a served synthetic checkpoint (`--served`: the
/// real vocabulary size and a generated `tokenizer.json` whose id 0 is
/// `<|endoftext|>`): the Phi text weights, the vision model with the
/// Starmie templates (id 50256 is no `<|endoftext|>`), BOS = EOS = 0, and
/// the same text weights `load_checkpoint` gives.
#[test]
fn served_directory_loads_text_vision_and_templates() {
    let Some(dir) = synth("served", &["--seed", "5", "--served"]) else {
        return;
    };
    let model = kestrel_model::load(&dir).unwrap();
    let vision = model
        .vision
        .as_ref()
        .expect("a Moondream directory has vision");
    assert_eq!(
        vision.prompts,
        kestrel_model::moondream::PromptTokens::starmie()
    );
    assert_eq!(vision.config.tokens, vision.prompts);
    assert!(vision.region.is_some());
    assert_eq!(
        (model.bos_token_id, model.eos_token_ids.clone()),
        (Some(0), vec![0])
    );
    let c = &model.weights.config;
    assert_eq!(c.architecture, kestrel_model::Family::Phi);
    assert_eq!((c.vocab_size, c.hidden_size, c.num_layers), (51200, 32, 2));
    assert_eq!(c.features.rotary_dim, Some(4));
    assert!(model.chat_template.is_none());
    // The question is plain ids inside the vocabulary.
    let ids = model.encode("What is in the image?").unwrap();
    assert!(!ids.is_empty() && ids.iter().all(|&t| (t as usize) < c.vocab_size));
    let direct = load(&dir).unwrap();
    assert_eq!(
        direct.text.token_embd.to_f32(),
        model.weights.token_embd.to_f32()
    );
    std::fs::remove_dir_all(dir).ok();
}
