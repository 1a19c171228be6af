//! Strategies shared by the property tests of the core and of both transports (feature
//! `proptest`; always on in this crate's own tests). The properties they feed say that
//! no content of a row or of a delivery can make the relay or a consumer panic.

use chrono::{DateTime, Utc};
use proptest::prelude::*;
use proptest::test_runner::Config;
use serde_json::value::RawValue;

/// 256 cases per property, and no regression files written into the repository.
pub fn config() -> Config {
    Config {
        cases: 256,
        failure_persistence: None,
        ..Config::default()
    }
}

/// Any text of up to `max_chars` characters: every `char` (controls, NUL, CR/LF,
/// non-BMP) is possible.
pub fn text(max_chars: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(any::<char>(), 0..=max_chars).prop_map(String::from_iter)
}

/// Any instant `chrono` can hold, leap-second nanoseconds included.
pub fn any_time() -> impl Strategy<Value = DateTime<Utc>> {
    (
        DateTime::<Utc>::MIN_UTC.timestamp()..=DateTime::<Utc>::MAX_UTC.timestamp(),
        0u32..2_000_000_000,
    )
        .prop_filter_map("not an instant", |(secs, nanos)| {
            DateTime::from_timestamp(secs, nanos)
        })
}

/// A JSON payload of exactly `size` bytes (a string, or `0` below 2 bytes).
///
/// # Panics
/// Never: the text is always JSON.
pub fn payload(size: usize) -> Box<RawValue> {
    let json = if size < 2 {
        "0".to_owned()
    } else {
        format!("\"{}\"", "a".repeat(size - 2))
    };
    RawValue::from_string(json).expect("valid JSON")
}
