//! The `outbox` binary: see `outbox --help` and docs/operations.md.

/// jemalloc (feature `jemalloc`, on by default): glibc's allocator let a long-running
/// relay's resident size creep up in steps, jemalloc does not (docs/performance.md,
/// Memory of a long-running relay).
#[cfg(all(feature = "jemalloc", not(target_env = "msvc")))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read once at its start (jemalloc's `opt.*`, "Run-time
/// configuration" of its manual): a background thread returns freed pages to the system
/// after 1 s (`dirty_decay_ms`, 10 s by default) and lazily freed pages at once
/// (`muzzy_decay_ms`). With the defaults the WAL relay's peak resident set while it
/// publishes a 200 MB producer transaction rose from 106 MiB (glibc) to 162 MiB; with
/// these, 122-124 MiB (docs/performance.md, Peak memory of a large transaction). The
/// environment variable `_RJEM_MALLOC_CONF` is read after this and overrides it.
#[cfg(all(feature = "jemalloc", not(target_env = "msvc")))]
#[allow(unsafe_code)]
// SAFETY: jemalloc (tikv-jemalloc-sys, built with the `_rjem_` prefix) declares
// `extern const char *_rjem_malloc_conf` and reads it once at its initialisation; this
// static is exactly that pointer (`repr(transparent)`), to a NUL-terminated string
// that lives for the whole program, and no other library of the binary exports the
// symbol.
#[unsafe(export_name = "_rjem_malloc_conf")]
static MALLOC_CONF: MallocConf =
    MallocConf(c"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0".as_ptr());

/// A C string pointer jemalloc reads, shareable between threads: it is never written.
#[cfg(all(feature = "jemalloc", not(target_env = "msvc")))]
#[repr(transparent)]
struct MallocConf(*const std::ffi::c_char);

// SAFETY: the pointer is to a `'static` string literal and never written.
#[cfg(all(feature = "jemalloc", not(target_env = "msvc")))]
#[allow(unsafe_code)]
unsafe impl Sync for MallocConf {}

fn main() -> std::process::ExitCode {
    outboxkit_cli::main_with_args(std::env::args_os())
}
