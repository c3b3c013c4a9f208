//! Kestrel's side of the Moondream bench: the encoder timed alone
//! (`kestrel_cpu::vision::encode_image`, the call the CPU runtime makes for
//! a new image, on a `Team` of the same threads), and the served engine
//! (`kestrel_engine::Engine`) driven through its async API as a server's
//! handlers drive it: PNG bytes in, each request on a task of its own.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use kestrel_cpu::vision::{encode_image, VisionRun};
use kestrel_cpu::{Isa, Team};
use kestrel_engine::{Engine, EngineConfig, GenerateRequest, ModelSource, Prompt, VisionTask};
use kestrel_model::LoadedModel;

use super::report::{ConcurrencyRow, EncodeRow, Figures};
use super::{BenchImage, Options, RoundImages, ENCODE_REPS, QUESTION, SECOND_QUESTION};

/// The token ids of the query prompt around the image (for the floor).
#[derive(Debug, Clone, serde::Serialize)]
pub struct QueryPrompts {
    /// Before the image's rows: BOS.
    pub before: Vec<u32>,
    /// After them: the query template around [`QUESTION`].
    pub after: Vec<u32>,
    /// The same around [`SECOND_QUESTION`].
    pub after_second: Vec<u32>,
}

pub struct KestrelBench<'a> {
    opts: &'a Options,
    loaded: &'a LoadedModel,
    /// Pipelined (the engine's default): every figure but the blocking rows.
    engine: Engine,
    /// The same configuration, blocking (point/detect table only).
    blocking: Option<Engine>,
    rt: tokio::runtime::Runtime,
    team: Team,
    pub prompts: QueryPrompts,
}

impl<'a> KestrelBench<'a> {
    pub fn start(opts: &'a Options, ckpt: &Path, loaded: &'a LoadedModel) -> anyhow::Result<Self> {
        let max_streams = opts.streams.iter().copied().max().unwrap_or(1);
        let page_size = 16;
        // BOS + 729 image rows + a template, then the tokens.
        let seq = 760 + opts.max_tokens.max(opts.decode_tokens) as usize;
        let config = EngineConfig {
            model: ModelSource::Path(ckpt.to_owned()),
            threads: opts.threads,
            numerics: opts.numerics,
            max_batch_size: max_streams,
            max_seq_len: Some(seq.next_multiple_of(page_size)),
            page_size,
            // Every row at full length at once, and as many image prefixes
            // again kept in the prefix cache (the point/detect table's).
            kv_pages: (2 * max_streams + 4) * seq.div_ceil(page_size) + 64,
            max_waiting: 4 * max_streams + 16,
            images: kestrel_engine::ImageSettings {
                cache: 2 * max_streams + 8,
                ..kestrel_engine::ImageSettings::default()
            },
            ..EngineConfig::default()
        };
        let blocking = if opts.spatial {
            Some(
                Engine::start(
                    EngineConfig {
                        mode: kestrel_engine::PipelineMode::Blocking,
                        ..config.clone()
                    },
                    |_| {},
                )
                .context("starting the blocking Moondream engine")?,
            )
        } else {
            None
        };
        let engine = Engine::start(config, |_| {}).context("starting the Moondream engine")?;
        let v = loaded.vision.as_ref().context("a vision model")?;
        let p = &v.prompts;
        let template = |q: &str| -> anyhow::Result<Vec<u32>> {
            let text = if p.leading_space {
                format!(" {q}")
            } else {
                q.to_string()
            };
            let ids = engine.tokenize(&text, false)?;
            Ok([&p.query_prefix[..], &ids, &p.query_suffix].concat())
        };
        let prompts = QueryPrompts {
            before: vec![p.bos_id],
            after: template(QUESTION)?,
            after_second: template(SECOND_QUESTION)?,
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_time()
            .build()
            .context("tokio runtime")?;
        let team = Team::new(opts.threads, "md-bench-encode").context("encoder threads")?;
        Ok(Self {
            opts,
            loaded,
            engine,
            blocking,
            rt,
            team,
            prompts,
        })
    }

    pub fn describe(&self) -> String {
        format!(
            "kestrel (cpu, isa={:?}, numerics={:?}, {} threads)",
            Isa::detect(),
            self.opts.numerics,
            self.opts.threads
        )
    }

    /// One round: every figure on this round's images.
    pub fn run(&mut self, images: &RoundImages) -> anyhow::Result<Figures> {
        let encodes0 = self.encodes();
        let encode = self.encode_table(&images.encode)?;
        let (mut cold, mut cached) = (Vec::new(), Vec::new());
        for img in &images.query {
            cold.push(self.first_token(img, QUESTION)?);
            cached.push(self.first_token(img, SECOND_QUESTION)?);
        }
        let decode = self.decode_rate(&images.decode)?;
        let concurrency = self
            .opts
            .streams
            .iter()
            .zip(&images.concurrency)
            .map(|(&c, imgs)| self.concurrency(c, imgs))
            .collect::<anyhow::Result<Vec<_>>>()?;
        // Every image of the round is new to the engine: had one hit the
        // encoded-image or prefix cache, its figures would time the cache.
        let new_images =
            images.query.len() + 1 + images.concurrency.iter().flatten().flatten().count();
        let encodes = self.encodes() - encodes0;
        if encodes != new_images as u64 {
            bail!("{encodes} images encoded for {new_images} new ones: the bench's images repeat");
        }
        Ok(Figures {
            engine: self.describe(),
            encode,
            ttft_cold_s: median(&mut cold),
            ttft_cached_s: median(&mut cached),
            decode_tokens_per_s: decode,
            concurrency,
        })
    }

    /// Images the engine has encoded (`kestrel_image_encodes_total`).
    fn encodes(&self) -> u64 {
        self.engine
            .metrics_text()
            .lines()
            .find_map(|l| {
                l.strip_prefix("kestrel_image_encodes_total ")?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or(0)
    }

    fn encode_table(&self, images: &[BenchImage]) -> anyhow::Result<Vec<EncodeRow>> {
        let v = self.loaded.vision.as_ref().context("a vision model")?;
        let run = VisionRun {
            team: Some(&self.team),
            isa: Isa::detect(),
            numerics: self.opts.numerics,
        };
        images
            .iter()
            .map(|img| {
                let mut t = Vec::new();
                for _ in 0..ENCODE_REPS {
                    let t0 = Instant::now();
                    let tokens =
                        encode_image(run, &v.weights, &v.config.vision, &img.prepared.crops)
                            .context("encoding an image")?;
                    t.push(t0.elapsed().as_secs_f64());
                    std::hint::black_box(tokens);
                }
                Ok(EncodeRow {
                    crops: img.prepared.crops.count(),
                    seconds: median(&mut t),
                })
            })
            .collect()
    }

    fn query(img: &BenchImage, question: &str, tokens: u32) -> GenerateRequest {
        GenerateRequest {
            input: Prompt::Vision {
                image: img.png.clone(),
                task: VisionTask::Query {
                    question: question.into(),
                },
            },
            // Every request runs its full length: equal work in both engines.
            ignore_eos: true,
            ..GenerateRequest::text("unused", tokens)
        }
    }

    /// Seconds from handing the request (PNG bytes) to the engine to its
    /// first token, seen by the caller.
    fn first_token(&self, img: &BenchImage, question: &str) -> anyhow::Result<f64> {
        let req = Self::query(img, question, 1);
        self.rt.block_on(async {
            let t0 = Instant::now();
            let resp = self.engine.generate(req).await?;
            anyhow::ensure!(resp.token_ids.len() == 1, "one token expected");
            Ok(t0.elapsed().as_secs_f64())
        })
    }

    /// One sequence's tokens/s after its first token (the engine's own
    /// figure, `Timings::tokens_per_s`).
    fn decode_rate(&self, img: &BenchImage) -> anyhow::Result<f64> {
        let req = Self::query(img, QUESTION, self.opts.decode_tokens);
        let resp = self.rt.block_on(self.engine.generate(req))?;
        if resp.token_ids.len() != self.opts.decode_tokens as usize {
            bail!("the decode request gave {} tokens", resp.token_ids.len());
        }
        Ok(resp.timings.tokens_per_s)
    }

    /// `streams` tasks, each running its images' queries back to back.
    fn concurrency(
        &self,
        streams: usize,
        images: &[Vec<BenchImage>],
    ) -> anyhow::Result<ConcurrencyRow> {
        let engine = self.engine.clone();
        let n_tok = self.opts.max_tokens;
        let per_stream: Vec<Vec<GenerateRequest>> = images
            .iter()
            .map(|s| s.iter().map(|i| Self::query(i, QUESTION, n_tok)).collect())
            .collect();
        let requests: usize = per_stream.iter().map(Vec::len).sum();
        let (wall, tokens) = self.rt.block_on(async {
            let t0 = Instant::now();
            let tasks: Vec<_> = per_stream
                .into_iter()
                .map(|reqs| {
                    let engine = engine.clone();
                    tokio::spawn(async move {
                        let mut tokens = 0usize;
                        for r in reqs {
                            tokens += engine.generate(r).await?.token_ids.len();
                        }
                        anyhow::Ok(tokens)
                    })
                })
                .collect();
            let mut tokens = 0;
            for t in tasks {
                tokens += t.await.context("a request task")??;
            }
            anyhow::Ok((t0.elapsed().as_secs_f64(), tokens))
        })?;
        if tokens != requests * n_tok as usize {
            bail!("{tokens} tokens from {requests} requests of {n_tok}");
        }
        Ok(ConcurrencyRow {
            streams,
            requests,
            wall_s: wall,
            requests_per_s: requests as f64 / wall,
            tokens_per_s: tokens as f64 / wall,
        })
    }

    /// The point/detect table's runs of one round: every slot count and
    /// kind on both engines, the engine that goes first rotating.
    pub fn spatial(
        &self,
        images: &RoundImages,
        rep: usize,
    ) -> anyhow::Result<Vec<super::spatial::SpatialRun>> {
        use super::spatial::{run, Kind, Mode, Workload};
        let blocking = self.blocking.as_ref().context("no blocking engine")?;
        let engines = [(Mode::Blocking, blocking), (Mode::Pipelined, &self.engine)];
        let mut out = Vec::new();
        for (si, (&streams, imgs)) in self.opts.streams.iter().zip(&images.spatial).enumerate() {
            for (ki, kind) in Kind::ALL.into_iter().enumerate() {
                let w = Workload {
                    kind,
                    streams,
                    requests_per_stream: self.opts.requests_per_stream,
                    max_tokens: self.opts.max_tokens,
                    max_objects: self.opts.max_objects,
                };
                for k in 0..2 {
                    let (mode, engine) = engines[(k + rep + si + ki) % 2];
                    out.push(run(&self.rt, engine, mode, rep, &w, imgs)?);
                }
            }
        }
        Ok(out)
    }

    pub fn shutdown(self) {
        let Self {
            engine,
            blocking,
            rt,
            ..
        } = self;
        rt.block_on(async {
            engine.shutdown(Duration::from_secs(10)).await;
            if let Some(b) = blocking {
                b.shutdown(Duration::from_secs(10)).await;
            }
        });
    }
}

pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}
