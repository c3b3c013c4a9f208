//! The PyTorch floor: `scripts/bench/moondream_torch.py` run as a child
//! process on a plan of this round's images (Kestrel's crops written as
//! raw `u8` files, so both engines encode the same pixels) and the query
//! prompt's token ids; it times itself after loading and warming up, and
//! writes the same figures Kestrel's side reports.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _};
use serde_json::json;

use super::kestrel::QueryPrompts;
use super::report::Figures;
use super::{floor_dir, BenchImage, Options, RoundImages, ENCODE_REPS, QUERY_PROBES};
use crate::bench::workspace_root;

pub struct Floor<'a> {
    python: PathBuf,
    ckpt: PathBuf,
    opts: &'a Options,
}

impl<'a> Floor<'a> {
    /// Checks that `python` has what the floor imports.
    pub fn new(python: &Path, ckpt: &Path, opts: &'a Options) -> anyhow::Result<Self> {
        let out = Command::new(python)
            .args(["-c", "import torch, numpy, safetensors"])
            .output()
            .with_context(|| format!("running {}", python.display()))?;
        if !out.status.success() {
            bail!(
                "{} cannot import torch, numpy, safetensors: {}",
                python.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(Self {
            python: python.to_owned(),
            ckpt: ckpt.to_owned(),
            opts,
        })
    }

    /// One round on `images` (the same ones Kestrel's side of the round
    /// gets, or got).
    pub fn run(
        &self,
        images: &RoundImages,
        prompts: &QueryPrompts,
        rep: usize,
    ) -> anyhow::Result<Figures> {
        let dir = floor_dir(self.opts, rep);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut n = 0usize;
        let mut spec = |img: &BenchImage| -> anyhow::Result<serde_json::Value> {
            n += 1;
            let path = dir.join(format!("crops{n}.u8"));
            let c = &img.prepared.crops;
            std::fs::write(&path, &c.pixels)
                .with_context(|| format!("writing {}", path.display()))?;
            Ok(json!({"crops": path, "rows": c.tiling.rows, "cols": c.tiling.cols}))
        };
        let encode = images
            .encode
            .iter()
            .map(&mut spec)
            .collect::<anyhow::Result<Vec<_>>>()?;
        let query = spec(&images.query[0])?;
        let concurrency = self
            .opts
            .streams
            .iter()
            .zip(&images.concurrency)
            .map(|(&c, per_stream)| {
                // Wave k: every stream's k-th request, batched together.
                let waves = (0..self.opts.requests_per_stream)
                    .map(|k| {
                        per_stream
                            .iter()
                            .map(|s| spec(&s[k]))
                            .collect::<anyhow::Result<Vec<_>>>()
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?;
                Ok(json!({"streams": c, "waves": waves, "max_tokens": self.opts.max_tokens}))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut q = query;
        q["before"] = json!(prompts.before);
        q["after"] = json!(prompts.after);
        q["after_cached"] = json!(prompts.after_second);
        q["decode_tokens"] = json!(self.opts.decode_tokens);
        q["reps"] = json!(QUERY_PROBES);
        let plan = json!({
            "encode": encode,
            "encode_reps": ENCODE_REPS,
            "query": q,
            "concurrency": concurrency,
        });
        let plan_path = dir.join("plan.json");
        let out_path = dir.join("floor.json");
        std::fs::write(&plan_path, serde_json::to_string_pretty(&plan)?)?;
        let status = Command::new(&self.python)
            .arg(workspace_root().join("scripts/bench/moondream_torch.py"))
            .arg(&self.ckpt)
            .arg(&plan_path)
            .arg(&out_path)
            .args(["--threads", &self.opts.threads.to_string()])
            .status()
            .with_context(|| format!("running {}", self.python.display()))?;
        if !status.success() {
            bail!("moondream_torch.py failed ({status})");
        }
        let text = std::fs::read_to_string(&out_path)
            .with_context(|| format!("reading {}", out_path.display()))?;
        let fig: Figures = serde_json::from_str(&text).context("the floor's figures")?;
        // The crops are big and rewritten every round: keep only the plan
        // and the figures.
        for entry in std::fs::read_dir(&dir)?.flatten() {
            if entry.path().extension().is_some_and(|e| e == "u8") {
                std::fs::remove_file(entry.path()).ok();
            }
        }
        Ok(fig)
    }
}
