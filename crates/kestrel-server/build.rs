//! Compiles `proto/kestrel/v1/kestrel.proto` with `protox` (pure Rust, so no
//! `protoc` binary is needed) and feeds the descriptors to tonic's code
//! generator. Also writes the encoded `FileDescriptorSet` to
//! `$OUT_DIR/kestrel_descriptor.bin` for gRPC server reflection.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto_root = manifest.join("../../proto");
    let proto_file = proto_root.join("kestrel/v1/kestrel.proto");
    println!("cargo:rerun-if-changed={}", proto_file.display());

    let fds = protox::compile([&proto_file], [&proto_root])?;

    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptor_path = out_dir.join("kestrel_descriptor.bin");
    std::fs::write(&descriptor_path, prost::Message::encode_to_vec(&fds))?;

    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
