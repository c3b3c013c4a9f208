//! `#[repr(C)]` structs shared with the kernels, the one place their layout
//! is defined on the Rust side. Each mirrors a struct in `kernels/*.cu`;
//! a size/offset test pins the layout so the two cannot drift silently.

use kestrel_pipeline::SamplingParams;

/// Per-row sampling parameters, mirroring `struct SampleParams` in
/// `kernels/sample.cu` (40 bytes, 8-byte aligned).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SampleParams {
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub _pad: u32,
    pub seed: u64,
}

impl From<&SamplingParams> for SampleParams {
    fn from(p: &SamplingParams) -> Self {
        SampleParams {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            frequency_penalty: p.frequency_penalty,
            presence_penalty: p.presence_penalty,
            _pad: 0,
            seed: p.seed,
        }
    }
}

// SAFETY: `SampleParams` is `#[repr(C)]`, made only of plain integers and
// floats (every bit pattern valid), with the layout of the CUDA struct
// (checked by `sample_params_layout_matches_the_kernel`).
unsafe impl cudarc::driver::DeviceRepr for SampleParams {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn sample_params_layout_matches_the_kernel() {
        assert_eq!(size_of::<SampleParams>(), 40);
        assert_eq!(align_of::<SampleParams>(), 8);
        assert_eq!(offset_of!(SampleParams, top_k), 4);
        assert_eq!(offset_of!(SampleParams, presence_penalty), 24);
        assert_eq!(offset_of!(SampleParams, seed), 32);
        let src = crate::kernels::SOURCES
            .iter()
            .find(|k| k.file == "sample.cu")
            .expect("sample.cu")
            .source;
        let body = src
            .split("struct SampleParams {")
            .nth(1)
            .and_then(|s| s.split("};").next())
            .expect("struct in sample.cu");
        let fields: Vec<&str> = body
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(|l| l.trim_end_matches(';').rsplit(' ').next().unwrap_or(""))
            .collect();
        assert_eq!(
            fields,
            [
                "temperature",
                "top_k",
                "top_p",
                "min_p",
                "repetition_penalty",
                "frequency_penalty",
                "presence_penalty",
                "_pad",
                "seed"
            ]
        );
    }

    #[test]
    fn from_sampling_params_copies_every_field() {
        let p = SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            repetition_penalty: 1.1,
            frequency_penalty: 0.2,
            presence_penalty: 0.3,
            seed: 42,
            ..SamplingParams::default()
        };
        let s = SampleParams::from(&p);
        assert_eq!(
            (s.temperature, s.top_k, s.top_p, s.min_p, s.seed),
            (0.7, 40, 0.9, 0.05, 42)
        );
        assert_eq!(
            (
                s.repetition_penalty,
                s.frequency_penalty,
                s.presence_penalty
            ),
            (1.1, 0.2, 0.3)
        );
    }
}
