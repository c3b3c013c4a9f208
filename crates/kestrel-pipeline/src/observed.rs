//! `Observed<E, O>`: an executor that forwards every call to `E` and lets an
//! observer act around `wait_step` (time it, delay it). One forwarding
//! wrapper for benches and tests, so a new `Executor` method is forwarded in
//! one place instead of being silently defaulted in each copy.

use crate::executor::{
    Capabilities, Drafts, ExecError, Executor, MaskBatch, PrefillInput, SlotId, StepOutputs,
};
use crate::{RequestId, TokenId};

/// Hooks around the one blocking call of an executor.
pub trait WaitObserver {
    /// Right before the scheduler blocks on `slot`'s step.
    fn before_wait(&mut self, slot: SlotId) {
        let _ = slot;
    }
    /// Right after the step's outputs arrived (or the wait failed).
    fn after_wait(&mut self, slot: SlotId) {
        let _ = slot;
    }
}

/// See the module docs.
#[derive(Debug)]
pub struct Observed<E, O> {
    pub inner: E,
    pub observer: O,
}

impl<E: Executor, O: WaitObserver> Executor for Observed<E, O> {
    type Params = E::Params;
    type Error = E::Error;

    fn num_slots(&self) -> usize {
        self.inner.num_slots()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn num_allocated(&self) -> usize {
        self.inner.num_allocated()
    }
    fn can_admit(&self, prompt: &[TokenId], max_len: usize) -> bool {
        self.inner.can_admit(prompt, max_len)
    }
    fn grow(&mut self, id: RequestId, len: usize) -> bool {
        self.inner.grow(id, len)
    }
    fn could_ever_fit(&self, max_len: usize) -> bool {
        self.inner.could_ever_fit(max_len)
    }
    fn launch_prefill(
        &mut self,
        slot: SlotId,
        seqs: &[PrefillInput<'_, Self::Params>],
    ) -> Result<(), ExecError<Self::Error>> {
        self.inner.launch_prefill(slot, seqs)
    }
    fn cached_prompt_tokens(&self, id: RequestId) -> usize {
        self.inner.cached_prompt_tokens(id)
    }
    fn launch_decode(
        &mut self,
        slot: SlotId,
        rows: &[RequestId],
        drafts: Drafts<'_>,
    ) -> Result<(), ExecError<Self::Error>> {
        self.inner.launch_decode(slot, rows, drafts)
    }
    fn finalize_sampling(
        &mut self,
        slot: SlotId,
        masks: Option<&MaskBatch<'_>>,
    ) -> Result<(), ExecError<Self::Error>> {
        self.inner.finalize_sampling(slot, masks)
    }
    fn wait_step(&mut self, slot: SlotId) -> Result<StepOutputs<'_>, Self::Error> {
        self.observer.before_wait(slot);
        let out = self.inner.wait_step(slot);
        self.observer.after_wait(slot);
        out
    }
    fn release(&mut self, id: RequestId) {
        self.inner.release(id);
    }
    fn preempt(&mut self, id: RequestId, tokens: &[TokenId]) {
        self.inner.preempt(id, tokens);
    }
    fn release_all(&mut self) {
        self.inner.release_all();
    }
    fn on_resume(&mut self) -> Result<(), Self::Error> {
        self.inner.on_resume()
    }
    fn record_timings(&mut self, on: bool) -> Result<(), Self::Error> {
        self.inner.record_timings(on)
    }
    fn drain_timings(&mut self, out: &mut Vec<crate::StepTiming>) {
        self.inner.drain_timings(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{SimConfig, SimExecutor};

    struct Quiet;
    impl WaitObserver for Quiet {}

    /// The wrapper answers with its inner runtime's capabilities, whatever
    /// they are (a wrapper that defaulted one would differ here).
    #[test]
    fn observed_forwards_capabilities() {
        for (max_rows, max_draft_tokens) in [(3, 0), (64, 5)] {
            let inner = SimExecutor::new(SimConfig {
                max_rows,
                max_draft_tokens,
                ..SimConfig::default()
            });
            let caps = inner.capabilities();
            assert_eq!(
                (caps.max_rows, caps.max_draft_tokens),
                (max_rows, max_draft_tokens)
            );
            let observed = Observed {
                inner,
                observer: Quiet,
            };
            assert_eq!(observed.capabilities(), caps);
        }
    }
}
