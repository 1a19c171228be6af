//! `cargo xtask bench`: relay throughput PostgreSQL → RabbitMQ or NATS JetStream next to
//! the broker and store ceilings measured in the same run, or with `--consumer` the
//! consumer side. The benchmark lives in the `outboxkit_lab::bench` module.

use clap::Parser as _;
use outboxkit_lab::bench::{self, Args};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,lapin=off".into()),
        )
        .init();
    bench::main(Args::parse()).await
}
