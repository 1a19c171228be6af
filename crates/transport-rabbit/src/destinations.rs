//! Destination rules: which routing keys share one circuit of the relay
//! ([`EventPublisher::destination`](outboxkit_core::EventPublisher::destination)).
//!
//! When a queue is full (`x-max-length` with `x-overflow: reject-publish`), RabbitMQ
//! answers the publish with a `basic.nack` that names no queue, and one routing key may
//! reach several queues through the exchange's bindings. So the transport cannot learn
//! which queue refused. **By default every routing key is its own destination**: a
//! refusal holds back only that routing key's messages, never a key whose queues take
//! messages; one full queue bound behind many routing keys (`orders.#`) then opens one
//! circuit per routing key (bounded by the relay, each tried on its own).
//!
//! An operator who knows the bindings says which routing keys go to one queue:
//! `orders.#=orders` makes every routing key matching the AMQP topic pattern
//! `orders.#` one destination named `orders`: one circuit, one trial at a time, one
//! release, however many routing keys there are. Rules are tried in order; the first
//! that matches names the destination; a routing key no rule matches is its own. A
//! rule that groups routing keys bound to different queues holds back all of them
//! while one of those queues is full.

use std::fmt;
use std::str::FromStr;

use crate::error::RabbitError;

/// Most words in a pattern or routing key (a 255-byte AMQP short string holds at most
/// 128).
const MAX_WORDS: usize = 128;

/// One operator rule: routing keys matching `pattern` (an AMQP topic pattern: words
/// separated by `.`, `*` for exactly one word, `#` for zero or more) are the
/// destination `name`. Written `PATTERN=NAME` (its [`FromStr`] and [`Display`]).
///
/// ```
/// use outboxkit_rabbit::DestinationRule;
///
/// let rule: DestinationRule = "orders.#=orders-queue".parse()?;
/// assert_eq!(rule.destination_of("orders.eu.created"), Some("orders-queue"));
/// assert_eq!(rule.destination_of("payments.created"), None);
/// # Ok::<(), outboxkit_rabbit::RabbitError>(())
/// ```
///
/// [`Display`]: fmt::Display
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DestinationRule {
    pattern: String,
    name: String,
}

impl DestinationRule {
    /// Routing keys matching `pattern` are the destination `name`.
    ///
    /// # Errors
    /// [`RabbitError::InvalidConfig`] (field `destination_rules`) when the pattern is
    /// empty, longer than 255 bytes, has an empty word (`a..b`) or a word mixing a
    /// wildcard with other characters (`a*`), or the name is empty, longer than
    /// [`MAX_NAME_LEN`](outboxkit_core::MAX_NAME_LEN) bytes or holds a control character.
    pub fn new(pattern: impl Into<String>, name: impl Into<String>) -> Result<Self, RabbitError> {
        let (pattern, name) = (pattern.into(), name.into());
        let invalid = |reason: String| RabbitError::InvalidConfig {
            field: "destination_rules",
            reason,
        };
        if pattern.is_empty() || pattern.len() > 255 {
            return Err(invalid(format!(
                "pattern {pattern:?} must be 1 to 255 bytes"
            )));
        }
        if pattern.split('.').count() > MAX_WORDS {
            return Err(invalid(format!(
                "pattern {pattern:?} has more than {MAX_WORDS} words"
            )));
        }
        for word in pattern.split('.') {
            if word.is_empty() {
                return Err(invalid(format!("pattern {pattern:?} has an empty word")));
            }
            if word.len() > 1 && (word.contains('*') || word.contains('#')) {
                return Err(invalid(format!(
                    "pattern {pattern:?}: a wildcard (* or #) must be a whole word, not part of {word:?}"
                )));
            }
        }
        if name.is_empty() || name.len() > outboxkit_core::MAX_NAME_LEN {
            return Err(invalid(format!(
                "destination name {name:?} must be 1 to {} bytes",
                outboxkit_core::MAX_NAME_LEN
            )));
        }
        if name.chars().any(char::is_control) {
            return Err(invalid(format!(
                "destination name {name:?} holds a control character"
            )));
        }
        Ok(Self { pattern, name })
    }

    /// The pattern.
    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    /// The destination's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The destination's name when `routing_key` matches the pattern.
    pub fn destination_of(&self, routing_key: &str) -> Option<&str> {
        topic_matches(&self.pattern, routing_key).then_some(self.name.as_str())
    }
}

impl FromStr for DestinationRule {
    type Err = RabbitError;

    /// `PATTERN=NAME`, split at the last `=` (a pattern may hold one, a name may not).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.rsplit_once('=') {
            Some((pattern, name)) => Self::new(pattern.trim(), name.trim()),
            None => Err(RabbitError::InvalidConfig {
                field: "destination_rules",
                reason: format!("{s:?} is not PATTERN=NAME (e.g. orders.#=orders)"),
            }),
        }
    }
}

impl fmt::Display for DestinationRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.pattern, self.name)
    }
}

/// Whether the AMQP topic pattern `pattern` matches `routing_key`: words split on `.`,
/// `*` matches exactly one word, `#` zero or more (RabbitMQ's topic exchange,
/// <https://www.rabbitmq.com/tutorials/amqp-concepts#exchange-topic>). Linear in the
/// product of the word counts (no backtracking blow-up with many `#`).
pub(crate) fn topic_matches(pattern: &str, routing_key: &str) -> bool {
    let k: Vec<&str> = routing_key.split('.').collect();
    // can[j]: the pattern's words so far match the first j words of the key.
    let mut can = vec![false; k.len() + 1];
    let mut next = vec![false; k.len() + 1];
    can[0] = true;
    for word in pattern.split('.') {
        match word {
            "#" => {
                let mut any = false;
                for (n, c) in next.iter_mut().zip(&can) {
                    any |= *c;
                    *n = any;
                }
            }
            "*" => {
                next[0] = false;
                next[1..].copy_from_slice(&can[..k.len()]);
            }
            w => {
                next[0] = false;
                for j in 1..=k.len() {
                    next[j] = can[j - 1] && k[j - 1] == w;
                }
            }
        }
        std::mem::swap(&mut can, &mut next);
    }
    can[k.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_patterns_match_as_rabbitmq_does() {
        for (pattern, key, expected) in [
            ("orders.#", "orders", true),
            ("orders.#", "orders.a.b", true),
            ("orders.*", "orders.a", true),
            ("orders.*", "orders.a.b", false),
            ("orders.*", "orders", false),
            ("#", "anything.at.all", true),
            ("*.created", "orders.created", true),
            ("#.created", "a.b.created", true),
            ("#.created", "created", true),
            ("a.#.z", "a.z", true),
            ("a.#.z", "a.b.c.z", true),
            ("a.#.z", "a.b.c", false),
            ("orders.created", "orders.created", true),
            ("orders.created", "orders.updated", false),
        ] {
            assert_eq!(topic_matches(pattern, key), expected, "{pattern} ~ {key}");
        }
        // Many `#` against a long key: no exponential backtracking.
        let pattern = vec!["#"; 64].join(".") + ".x";
        let key = vec!["a"; 127].join(".");
        assert!(!topic_matches(&pattern, &key));
    }

    #[test]
    fn rules_parse_and_bad_ones_are_typed_errors() {
        let rule: DestinationRule = " orders.# = orders ".parse().expect("valid");
        assert_eq!(rule.to_string(), "orders.#=orders");
        assert_eq!(rule.destination_of("orders.x"), Some("orders"));
        for bad in ["orders.#", "=q", "a..b=q", "a*=q", "a.#=", "#=\u{7}"] {
            let e = bad.parse::<DestinationRule>().expect_err(bad);
            assert!(
                matches!(
                    e,
                    RabbitError::InvalidConfig {
                        field: "destination_rules",
                        ..
                    }
                ),
                "{bad}: {e}"
            );
        }
    }
}
