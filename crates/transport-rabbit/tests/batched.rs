//! `RabbitConsumer::run_batched`'s settings. Its behaviour on the broker (per-message
//! answers that never acknowledge another batch's deliveries, deferred deliveries,
//! panics, undecodable deliveries, shutdown) is checked by the transport conformance
//! suite (`tests/conformance.rs`).

mod common;

use std::time::Duration;

use transport_rabbit::{RabbitConsumer, RabbitConsumerBuilder, RabbitError};

use common::*;

/// Batch settings are validated.
#[test]
fn batch_settings_are_validated() {
    let builder = || RabbitConsumer::builder(build(config("x")), "q").with_prefetch(10);
    let field = |b: RabbitConsumerBuilder| match b.build() {
        Err(RabbitError::InvalidConfig { field, .. }) => field,
        other => panic!("expected InvalidConfig, got {other:?}"),
    };
    assert_eq!(field(builder().with_batch_size(0)), "batch_size");
    assert_eq!(field(builder().with_batch_size(11)), "batch_size");
    assert_eq!(
        field(builder().with_batch_linger(Duration::from_secs(2))),
        "batch_linger"
    );
    assert_eq!(
        field(builder().with_batches_in_flight(0)),
        "batches_in_flight"
    );
    assert_eq!(
        builder().build().expect("valid").batch_size(),
        10,
        "default: the prefetch"
    );
}
