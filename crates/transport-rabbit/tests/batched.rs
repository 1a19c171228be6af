//! `RabbitConsumer::run_batched`'s settings. Its behaviour on the broker (per-message
//! answers that never acknowledge another batch's deliveries, deferred deliveries,
//! panics, undecodable deliveries, shutdown) is checked by the transport conformance
//! suite (`tests/conformance.rs`).

mod common;

use outboxkit_core::BatchSettings;
use outboxkit_rabbit::{RabbitConsumer, RabbitConsumerConfig, RabbitError};

use common::*;

/// Batch settings are checked against the prefetch.
#[test]
fn batch_settings_are_validated() {
    let builder = || RabbitConsumerConfig::new(build(config("x")), "q").with_prefetch(10);
    let field = |b: RabbitConsumerConfig| match RabbitConsumer::new(b) {
        Err(RabbitError::InvalidConfig { field, .. }) => field,
        other => panic!("expected InvalidConfig, got {other:?}"),
    };
    // The limits are BatchSettings::check's (outboxkit-core's unit tests); the window here
    // is the prefetch.
    assert_eq!(
        field(builder().with_batch(BatchSettings::new().with_size(11))),
        "batch_size"
    );
    assert_eq!(
        RabbitConsumer::new(builder()).expect("valid").batch_size(),
        10,
        "default: the prefetch"
    );
}
