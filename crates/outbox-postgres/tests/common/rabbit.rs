//! RabbitMQ fixtures, shared with the other backends through `outboxkit-testkit`.
#![allow(unused_imports, unreachable_pub)] // reason: each test binary uses a different subset

pub use outboxkit_testkit::rabbit::*;

use std::time::Duration;

use outboxkit_rabbit::{RabbitConfig, RabbitPublisher};

/// A relay's publisher to `exchange`, declared by the test (a 3 s confirm timeout).
pub async fn publisher_to(exchange: &str) -> RabbitPublisher {
    publisher_with_rules(exchange, &[]).await
}

/// [`publisher_to`] with destination rules (`PATTERN=NAME` each).
pub async fn publisher_with_rules(exchange: &str, rules: &[&str]) -> RabbitPublisher {
    RabbitPublisher::connect(
        RabbitConfig::new(amqp_url())
            .with_exchange(exchange)
            .with_declare_exchange(false)
            .with_confirm_timeout(Duration::from_secs(3))
            .with_destination_rules(rules.iter().map(|r| r.parse().expect("rule"))),
    )
    .await
    .expect("publisher")
}
