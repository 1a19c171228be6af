//! `NatsConsumer::run_batched`'s settings. Its behaviour on the server (per-message
//! `+ACK`, `-NAK` with delay and `+TERM`, deferred messages kept with `+WPI` past
//! `ack_wait`, panics, undecodable messages, shutdown) is checked by the transport
//! conformance suite (`tests/conformance.rs`).

mod common;

use std::time::Duration;

use transport_nats::{NatsConsumer, NatsConsumerBuilder, NatsError};

use common::*;

/// Batch settings are validated.
#[test]
fn batch_settings_are_validated() {
    let config = transport_nats::NatsConfigBuilder::new(url())
        .build()
        .expect("valid");
    let builder = || NatsConsumer::builder(config.clone(), "S", "d").with_concurrency(10);
    let field = |b: NatsConsumerBuilder| match b.build() {
        Err(NatsError::InvalidConfig { field, .. }) => field,
        other => panic!("expected InvalidConfig, got {other:?}"),
    };
    assert_eq!(field(builder().with_batch_size(0)), "batch_size");
    assert_eq!(field(builder().with_batch_size(11)), "batch_size");
    assert_eq!(
        field(builder().with_batch_linger(Duration::from_secs(2))),
        "batch_linger"
    );
    assert_eq!(
        field(builder().with_batches_in_flight(65)),
        "batches_in_flight"
    );
    assert_eq!(
        builder().build().expect("valid").batch_size(),
        10,
        "default: the concurrency"
    );
}
