//! The filter of the listings and replays, as the pages' forms send it: parsed from
//! query or form pairs, turned into the store's filters, and written back into links
//! and hidden inputs so that a replay acts on exactly the filter that was previewed.

use chrono::{DateTime, Utc};
use maud::{Markup, html};
use outboxkit_core::{InboxDeadFilter, MessageFilter};
use uuid::Uuid;

use super::PageError;
use crate::config::parse_window;

/// Which dead letters a filter selects: the outbox's messages, or the consumers' dead
/// letters. Each side has its own fields: the outbox's rows have no consumer, and the
/// consumer dead letters carry no tenant or aggregate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// `/messages`, `/replay`.
    Outbox,
    /// `/inbox`, `/inbox/replay`.
    Inbox,
}

impl Side {
    /// The names of the side's text fields, in the forms' order.
    pub(crate) fn fields(self) -> &'static [&'static str] {
        match self {
            Self::Outbox => &[
                "event_type",
                "aggregate_type",
                "aggregate_id",
                "tenant",
                "since",
                "until",
                "error",
            ],
            Self::Inbox => &["consumer", "event_type", "since", "until", "error"],
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Outbox => "the outbox's messages",
            Self::Inbox => "consumer dead letters",
        }
    }
}

/// The filter fields of both sides; a side's [`Fields::from_pairs`] leaves the other
/// side's fields empty. Empty text means "any".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Fields {
    pub event_type: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub tenant: String,
    pub consumer: String,
    /// Lower time bound: RFC 3339 or a duration ago (`2h`).
    pub since: String,
    /// Upper time bound, same forms.
    pub until: String,
    /// Text the last error contains (case-insensitive, literally).
    pub error: String,
    /// Selected message ids (checkboxes, or one message's replay).
    pub ids: Vec<String>,
}

/// The names of the text fields of both sides.
const TEXT_FIELDS: [&str; 8] = [
    "event_type",
    "aggregate_type",
    "aggregate_id",
    "tenant",
    "consumer",
    "since",
    "until",
    "error",
];

impl Fields {
    /// The fields of `side` among `pairs` (keys that name no field are ignored; `id`
    /// may repeat).
    ///
    /// # Errors
    /// [`PageError::BadRequest`] for a field of the other side with a value (a
    /// consumer on the outbox, a tenant or an aggregate on the inbox): it would filter
    /// nothing, and a replay would act on more than the operator asked for (without
    /// the "replay every dead letter" confirmation when it was the only field).
    pub(crate) fn from_pairs(pairs: &[(String, String)], side: Side) -> Result<Self, PageError> {
        let mut f = Self::default();
        for (key, value) in pairs {
            let value = value.trim().to_owned();
            match key.as_str() {
                "id" if !value.is_empty() => f.ids.push(value),
                other => {
                    let own = side.fields().contains(&other);
                    if let Some(slot) = f.slot(other) {
                        if !own && !value.is_empty() {
                            return Err(PageError::BadRequest(format!(
                                "{other:?} does not filter {}: remove it (the fields are {})",
                                side.name(),
                                side.fields().join(", ")
                            )));
                        }
                        *slot = value;
                    }
                }
            }
        }
        Ok(f)
    }

    fn slot(&mut self, name: &str) -> Option<&mut String> {
        Some(match name {
            "event_type" => &mut self.event_type,
            "aggregate_type" => &mut self.aggregate_type,
            "aggregate_id" => &mut self.aggregate_id,
            "tenant" => &mut self.tenant,
            "consumer" => &mut self.consumer,
            "since" => &mut self.since,
            "until" => &mut self.until,
            "error" => &mut self.error,
            _ => return None,
        })
    }

    fn get(&self, name: &str) -> &str {
        match name {
            "event_type" => &self.event_type,
            "aggregate_type" => &self.aggregate_type,
            "aggregate_id" => &self.aggregate_id,
            "tenant" => &self.tenant,
            "consumer" => &self.consumer,
            "since" => &self.since,
            "until" => &self.until,
            "error" => &self.error,
            _ => "",
        }
    }

    fn ids(&self) -> Result<Vec<Uuid>, PageError> {
        self.ids
            .iter()
            .map(|id| {
                id.parse()
                    .map_err(|_| PageError::BadRequest(format!("{id:?} is not a message id")))
            })
            .collect()
    }

    fn window(&self, now: DateTime<Utc>) -> Result<crate::config::Window, PageError> {
        parse_window(some(&self.since), some(&self.until), now)
            .map_err(|e| PageError::BadRequest(e.to_string()))
    }

    /// The outbox filter (time bounds on `created_at`).
    ///
    /// # Errors
    /// [`PageError::BadRequest`] for a time that does not parse or an id that is not a
    /// UUID.
    pub(crate) fn message_filter(&self, now: DateTime<Utc>) -> Result<MessageFilter, PageError> {
        let (from, to) = self.window(now)?;
        let mut f = MessageFilter::new().with_ids(self.ids()?);
        f.from = from;
        f.to = to;
        f.tenant_id = some(&self.tenant).map(str::to_owned);
        f.aggregate_type = some(&self.aggregate_type).map(str::to_owned);
        f.aggregate_id = some(&self.aggregate_id).map(str::to_owned);
        f.event_type = some(&self.event_type).map(str::to_owned);
        f.error_contains = some(&self.error).map(str::to_owned);
        Ok(f)
    }

    /// The consumer dead-letter filter (time bounds on `dead_at` / `received_at`).
    ///
    /// # Errors
    /// As [`message_filter`](Self::message_filter).
    pub(crate) fn inbox_filter(&self, now: DateTime<Utc>) -> Result<InboxDeadFilter, PageError> {
        let (from, to) = self.window(now)?;
        let mut f = InboxDeadFilter::new();
        f.ids = self.ids()?;
        f.from = from;
        f.to = to;
        f.consumer = some(&self.consumer).map(str::to_owned);
        f.event_type = some(&self.event_type).map(str::to_owned);
        f.error_contains = some(&self.error).map(str::to_owned);
        Ok(f)
    }

    /// The non-empty fields as URL query pairs (ids last).
    pub(crate) fn pairs(&self) -> Vec<(&'static str, &str)> {
        let mut pairs: Vec<(&'static str, &str)> = TEXT_FIELDS
            .iter()
            .map(|name| (*name, self.get(name)))
            .filter(|(_, v)| !v.is_empty())
            .collect();
        pairs.extend(self.ids.iter().map(|id| ("id", id.as_str())));
        pairs
    }

    /// `path?query` with the fields and `extra` pairs, encoded.
    pub(crate) fn link(&self, path: &str, extra: &[(&str, &str)]) -> String {
        let mut q = url::form_urlencoded::Serializer::new(String::new());
        for (k, v) in extra.iter().copied().chain(self.pairs()) {
            q.append_pair(k, v);
        }
        let q = q.finish();
        if q.is_empty() {
            path.to_owned()
        } else {
            format!("{path}?{q}")
        }
    }

    /// Hidden inputs carrying the fields (for the confirmation form).
    pub(crate) fn hidden_inputs(&self) -> Markup {
        html! {
            @for (name, value) in self.pairs() {
                input type="hidden" name=(name) value=(value);
            }
        }
    }

    /// The fields as `name=value` text for the audit log and the pages.
    pub(crate) fn describe(&self) -> String {
        let pairs = self.pairs();
        if pairs.is_empty() {
            "everything".to_owned()
        } else {
            pairs
                .iter()
                .map(|(k, v)| format!("{k}={v:?}"))
                .collect::<Vec<_>>()
                .join(" ")
        }
    }

    /// Whether no field is set.
    pub(crate) fn is_empty(&self) -> bool {
        self.pairs().is_empty()
    }

    /// The filter form's text inputs for the fields of `side` (GET to `action`), with
    /// `extra` hidden pairs (the listed state).
    pub(crate) fn form(&self, action: &str, side: Side, extra: &[(&str, &str)]) -> Markup {
        html! {
            form.filters method="get" action=(action) {
                @for (k, v) in extra {
                    input type="hidden" name=(k) value=(v);
                }
                @for name in side.fields() {
                    label {
                        span { (label(name)) }
                        input type="text" name=(name) value=(self.get(name))
                            placeholder=(placeholder(name));
                    }
                }
                button type="submit" { "Filter" }
                a.reset href=(action_with(action, extra)) { "Clear" }
            }
        }
    }
}

fn action_with(action: &str, extra: &[(&str, &str)]) -> String {
    Fields::default().link(action, extra)
}

fn label(name: &str) -> &'static str {
    match name {
        "event_type" => "Event type",
        "aggregate_type" => "Aggregate type",
        "aggregate_id" => "Aggregate id",
        "tenant" => "Tenant",
        "consumer" => "Consumer",
        "since" => "Since",
        "until" => "Until",
        "error" => "Error contains",
        _ => "",
    }
}

fn placeholder(name: &str) -> &'static str {
    match name {
        "since" | "until" => "2h or 2025-01-31T12:00:00Z",
        "error" => "text, case-insensitive",
        _ => "any",
    }
}

fn some(text: &str) -> Option<&str> {
    (!text.is_empty()).then_some(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
        items
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn fields_round_trip_through_links_and_make_filters() {
        let id = Uuid::now_v7().to_string();
        let f = Fields::from_pairs(
            &pairs(&[
                ("event_type", " OrderPlaced "),
                ("error", "50% & <b>"),
                ("since", "2h"),
                ("id", &id),
                ("state", "dead"),
                ("tenant", ""),
                ("consumer", ""),
            ]),
            Side::Outbox,
        )
        .expect("fields");
        assert_eq!(f.event_type, "OrderPlaced");
        let link = f.link("/replay", &[("state", "dead")]);
        assert!(link.starts_with(
            "/replay?state=dead&event_type=OrderPlaced&since=2h&error=50%25+%26+%3Cb%3E&id="
        ));
        let back: Vec<(String, String)> =
            url::form_urlencoded::parse(link.split_once('?').expect("query").1.as_bytes())
                .into_owned()
                .collect();
        assert_eq!(Fields::from_pairs(&back, Side::Outbox).expect("fields"), f);
        let now = Utc::now();
        let m = f.message_filter(now).expect("filter");
        assert_eq!(m.event_type.as_deref(), Some("OrderPlaced"));
        assert_eq!(m.error_contains.as_deref(), Some("50% & <b>"));
        assert_eq!(m.tenant_id, None);
        assert_eq!(m.ids.len(), 1);
        assert!(m.from.is_some_and(|t| t < now));
        assert!(!f.is_empty());
        assert!(Fields::default().is_empty());
        assert_eq!(Fields::default().describe(), "everything");
    }

    #[test]
    fn bad_times_and_ids_are_bad_requests() {
        let bad_time = Fields::from_pairs(&pairs(&[("since", "yesterday-ish")]), Side::Outbox)
            .expect("fields");
        assert!(matches!(
            bad_time.message_filter(Utc::now()),
            Err(PageError::BadRequest(_))
        ));
        let bad_id = Fields::from_pairs(&pairs(&[("id", "42")]), Side::Inbox).expect("fields");
        assert!(matches!(
            bad_id.inbox_filter(Utc::now()),
            Err(PageError::BadRequest(_))
        ));
    }

    #[test]
    fn a_field_of_the_other_side_is_refused_not_ignored() {
        for (side, field) in [
            (Side::Outbox, "consumer"),
            (Side::Inbox, "tenant"),
            (Side::Inbox, "aggregate_type"),
            (Side::Inbox, "aggregate_id"),
        ] {
            match Fields::from_pairs(&pairs(&[(field, "x")]), side) {
                Err(PageError::BadRequest(why)) => assert!(why.contains(field), "{why}"),
                other => panic!("{field} on {side:?}: {other:?}"),
            }
        }
        let f =
            Fields::from_pairs(&pairs(&[("consumer", "billing")]), Side::Inbox).expect("fields");
        assert!(!f.is_empty());
    }
}
