//! A consumer process of `cargo xtask chaos`: the real transport consumer applying each
//! event's effect through the real inbox. The consumer lives in the
//! `outboxkit_lab::chaos::consumer` module.

use clap::Parser as _;
use outboxkit_lab::chaos::consumer::{self, Args};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    consumer::main(Args::parse()).await
}
