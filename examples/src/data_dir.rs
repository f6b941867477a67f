//! Where the examples' shipped data lives.

/// The data shipped with the examples (`examples/data`, provenance in its README.md).
pub fn examples_data_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data")
}
