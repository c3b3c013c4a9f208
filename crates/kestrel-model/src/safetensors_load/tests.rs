//! HF directory loading tests.
