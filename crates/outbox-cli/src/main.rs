//! The `outbox` binary: see `outbox --help` and docs/operations.md.

/// jemalloc (feature `jemalloc`, on by default): glibc's allocator let a long-running
/// relay's resident size creep up in steps, jemalloc does not (docs/performance.md,
/// Memory of a long-running relay).
#[cfg(all(feature = "jemalloc", not(target_env = "msvc")))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    outboxkit_cli::main_with_args(std::env::args_os())
}
