//! The consumer side: `GET /inbox` (consumer dead letters, filtered: idempotent-consumer
//! failures and durable-inbox `Dead` rows) and `GET /inbox/{id}` (a message's dead
//! letters, with its outbox row when this outbox produced it).

use axum::extract::{Path, Query, State};
use chrono::Utc;
use maud::{Markup, html};
use outboxkit_core::{InboxDeadFilter, InboxDeadKind, InboxDeadLetter};
use uuid::Uuid;

use super::filter::{Fields, Side};
use super::layout::{self, short, status, time};
use super::{Dashboard, PageError};

/// Dead letters listed at most (the store's listing is oldest first and not paged).
const SHOWN: usize = 200;

fn kind(k: InboxDeadKind) -> &'static str {
    match k {
        InboxDeadKind::Consumer => "consumer",
        InboxDeadKind::Durable => "durable inbox",
    }
}

/// `GET /inbox?FILTER`
pub(crate) async fn list(
    State(d): State<Dashboard>,
    Query(pairs): Query<Vec<(String, String)>>,
) -> Result<Markup, PageError> {
    let fields = Fields::from_pairs(&pairs, Side::Inbox)?;
    let filter = fields.inbox_filter(Utc::now())?;
    let rows = d.admin.inbox_dead_letters(&filter, SHOWN + 1).await?;
    let more = rows.len() > SHOWN;
    let rows = &rows[..rows.len().min(SHOWN)];
    let body = html! {
        (fields.form("/inbox", Side::Inbox, &[]))
        p.muted #count {
            @if more { "More than " (SHOWN) " match; the oldest " (SHOWN) " are shown (narrow the filter)." }
            @else { (rows.len()) " matching" }
        }
        @if !rows.is_empty() {
            div.actions {
                a.button.secondary #replay-filter href=(fields.link("/inbox/replay", &[])) {
                    "Replay all matching this filter…"
                }
                span.muted { "or tick messages below and replay the selection" }
            }
        }
        form method="get" action="/inbox/replay" {
            (table(rows))
            @if !rows.is_empty() {
                div.actions { button #replay-selected type="submit" { "Replay selected…" } }
            }
        }
    };
    Ok(layout::page(&d, "inbox", "Consumer dead letters", body))
}

fn table(rows: &[InboxDeadLetter]) -> Markup {
    html! {
        @if rows.is_empty() {
            p.muted { "No consumer dead letters." }
        } @else {
            table #inbox {
                thead {
                    tr {
                        th { input type="checkbox" data-select-all aria-label="select all"; }
                        th { "Message" } th { "Kind" } th { "Consumer" } th { "Event type" }
                        th { "Attempts" } th { "Dead at" } th { "Last error" }
                    }
                }
                tbody {
                    @for r in rows {
                        tr {
                            td { input type="checkbox" name="id" value=(r.message_id) aria-label="select"; }
                            td.mono { a href=(format!("/inbox/{}", r.message_id)) { (r.message_id) } }
                            td { (kind(r.kind)) }
                            td { (r.consumer.as_deref().unwrap_or("-")) }
                            td { (r.event_type) }
                            td { (r.attempts) }
                            td.mono { (time(Some(r.at))) }
                            td.error { (short(r.last_error.as_deref(), 120)) }
                        }
                    }
                }
            }
        }
    }
}

/// `GET /inbox/{id}`
pub(crate) async fn detail(
    State(d): State<Dashboard>,
    Path(id): Path<String>,
) -> Result<Markup, PageError> {
    let id: Uuid = id
        .parse()
        .map_err(|_| PageError::BadRequest(format!("{id:?} is not a message id")))?;
    let mut filter = InboxDeadFilter::new();
    filter.ids = vec![id];
    let (letters, message) =
        tokio::try_join!(d.admin.inbox_dead_letters(&filter, 100), d.admin.get(id))?;
    if letters.is_empty() {
        return Err(PageError::NotFound(format!(
            "no consumer dead letter for message {id}"
        )));
    }
    let body = html! {
        div.actions {
            a.button #replay-one href=(format!("/inbox/replay?id={id}")) { "Replay this message…" }
        }
        @for r in &letters {
            div.panel {
                dl.fields {
                    dt { "Kind" } dd { (kind(r.kind)) }
                    dt { "Consumer" } dd { (r.consumer.as_deref().unwrap_or("- (named in the error)")) }
                    dt { "Event type" } dd { (r.event_type) }
                    dt { "Attempts" } dd { (r.attempts) }
                    dt { "Dead at" } dd.mono { (time(Some(r.at))) }
                }
                h2 { "Last error" }
                @if let Some(e) = &r.last_error { pre.last-error { (e) } } @else { p.muted { "None." } }
            }
        }
        h2 { "The message in this outbox" }
        @match &message {
            None => p.muted { "Not in this outbox (produced elsewhere, or purged): a replay can only clear the dead letter, the redelivery is yours to arrange." },
            Some(m) => {
                p { (status(m.status)) " " a href=(format!("/messages/{}", m.id)) { "headers and payload" } }
            }
        }
    };
    Ok(layout::page(
        &d,
        "inbox",
        &format!("Consumer dead letter {id}"),
        body,
    ))
}
