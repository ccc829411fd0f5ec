use which::which;

/// Rebuild the eBPF object when bpf-linker changes (a newer LLVM can change codegen).
fn main() {
    let bpf_linker = which("bpf-linker").expect(
        "bpf-linker not found on PATH: run `cargo xtask setup` (it builds bpf-linker against LLVM 22)",
    );
    println!("cargo:rerun-if-changed={}", bpf_linker.display());
}
