//! `GET /`: the overview. Bounded gauges (the relay's own: pending, processing, dead,
//! oldest pending age), sent per minute over the last hour as a chart, consumer dead
//! letters, and, when the relay mounts the pages, its health and circuit. Refreshes
//! itself every 5 seconds.

use axum::extract::State;
use chrono::Duration as ChronoDuration;
use maud::{Markup, html};
use outboxkit_core::admin::PENDING_STATS_BOUND;
use outboxkit_core::{InboxDeadFilter, SentPerMinute};

use super::layout::{self, age, bounded, thousands};
use super::{Dashboard, PageError};

/// Consumer dead letters counted at most (the overview's count is bounded too).
const INBOX_BOUND: usize = 1_000;
/// Minutes of the sent chart.
const CHART_MINUTES: u32 = 60;
/// Relays listed: those heard of within this long.
const RELAYS_WITHIN: std::time::Duration = std::time::Duration::from_secs(3600);
/// Relays listed at most.
const RELAYS_SHOWN: usize = 50;
/// A relay whose last heartbeat is older than this is shown as silent (six health
/// checks at the default interval).
const SILENT_AFTER: std::time::Duration = std::time::Duration::from_secs(30);

/// `GET /`
pub(crate) async fn page(State(d): State<Dashboard>) -> Result<Markup, PageError> {
    let everything = InboxDeadFilter::new();
    let (stats, series, inbox_dead, relays) = tokio::join!(
        d.admin.pending_stats(),
        d.admin.sent_per_minute(CHART_MINUTES),
        d.admin.inbox_dead_letters(&everything, INBOX_BOUND),
        d.admin.relays_seen(RELAYS_WITHIN, RELAYS_SHOWN),
    );
    let (stats, series, inbox_dead) = (stats?, series?, inbox_dead?);
    let bound = u64::try_from(PENDING_STATS_BOUND).unwrap_or(u64::MAX);
    let pending = stats.new + stats.processing;
    let sent_hour: u64 = series.counts.iter().sum();
    let last_minute = series.counts.last().copied().unwrap_or(0);
    let body = html! {
        div #overview data-refresh="5" {
            div.cards {
                (card("Pending", &bounded(pending, bound), "/messages?state=pending", pending >= bound))
                (card("Processing", &thousands(stats.processing), "/messages?state=pending", false))
                (card("Dead", &bounded(stats.dead, bound), "/messages?state=dead", stats.dead > 0))
                (card("Oldest pending", &age(stats.oldest_pending_age), "/messages?state=pending", false))
                (card("Sent, last hour", &thousands(sent_hour), "/messages?state=sent", false))
                (card("Consumer dead letters", &bounded(inbox_dead.len() as u64, INBOX_BOUND as u64), "/inbox", !inbox_dead.is_empty()))
            }
            div.panel.chart {
                h2 { "Sent per minute, last hour" span.muted { " · peak " (thousands(series.counts.iter().copied().max().unwrap_or(0))) "/min" } }
                (chart(&series))
                div.legend {
                    span { "−60 min" }
                    span { (thousands(last_minute)) " in the last minute · counted from sent rows still in the table (none under sent retention “delete”)" }
                    span { "now" }
                }
            }
            h2 { "Relays" }
            (relays_seen(relays))
            @if d.health.is_some() {
                h2 { "This relay" }
                (relay(&d))
            }
            p.muted {
                "Counts stop at " (thousands(bound)) " (the relay's gauges), so the page costs the same at a million rows. "
                "Database clock at " (layout::time(Some(series.until))) "."
            }
        }
    };
    Ok(layout::page(&d, "overview", "Overview", body))
}

fn card(label: &str, value: &str, href: &str, alarm: bool) -> Markup {
    html! {
        a.card href=(href) {
            div.label { (label) }
            div class={"value" @if alarm { " bad" }} { (value) }
        }
    }
}

/// Bars of `series`, scaled to its largest minute, as inline SVG (no script).
fn chart(series: &SentPerMinute) -> Markup {
    const W: f64 = 600.0;
    const H: f64 = 120.0;
    let n = series.counts.len().max(1);
    let max = series.counts.iter().copied().max().unwrap_or(0).max(1);
    let step = W / n as f64;
    html! {
        svg viewBox=(format!("0 0 {W} {}", H + 14.0)) preserveAspectRatio="none" role="img"
            aria-label="messages sent per minute over the last hour" {
            line.axis x1="0" y1=(H) x2=(W) y2=(H) {}
            @for (i, count) in series.counts.iter().enumerate() {
                @let h = (*count as f64 / max as f64) * (H - 14.0);
                @let minutes_ago = (n - 1 - i) as i64;
                @let at = series.until - ChronoDuration::minutes(minutes_ago);
                rect.bar x=(format!("{:.1}", i as f64 * step + 1.0)) y=(format!("{:.1}", H - h))
                    width=(format!("{:.1}", (step - 2.0).max(1.0))) height=(format!("{h:.1}")) {
                    title { (at.format("%H:%M")) "Z: " (thousands(*count)) " sent" }
                }
            }
        }
    }
}

/// The relays heard of in the last hour, from their heartbeats.
fn relays_seen(
    relays: Result<Vec<outboxkit_core::RelaySeen>, outboxkit_core::OutboxError>,
) -> Markup {
    let relays = match relays {
        Ok(r) => r,
        Err(e) => {
            return html! {
                div.panel {
                    p.error { "Relay heartbeats cannot be read (run " code { "outbox migrate" } "?): " (e) }
                }
            };
        }
    };
    html! {
        @if relays.is_empty() {
            div.panel { p.muted #relays { "No relay has reported a heartbeat in the last hour." } }
        } @else {
            table #relays {
                thead {
                    tr {
                        th { "Host" } th { "Pid" } th { "Version" } th { "Started" } th { "Last heartbeat" }
                        th { "Circuit" } th { "Health" } th { "Published" }
                    }
                }
                tbody {
                    @for r in &relays {
                        tr {
                            td { (r.host) }
                            td { (r.pid) }
                            td { (r.version) }
                            td.mono { (layout::time(Some(r.started_at))) }
                            td {
                                (age(Some(r.silent_for))) " ago"
                                @if r.silent_for > SILENT_AFTER { " " span.badge.bad { "silent" } }
                            }
                            td {
                                @if r.circuit_open { span.badge.bad { "open" } } @else { span.badge.ok { "closed" } }
                            }
                            td {
                                @if r.healthy { span.badge.ok { "ok" } }
                                @else { span.badge.bad title=(r.detail) { "unhealthy" } " " span.error { (layout::short(Some(&r.detail), 80)) } }
                            }
                            td { (thousands(r.published)) }
                        }
                    }
                }
            }
        }
    }
}

/// The health of the relay serving the pages (`outbox relay --dashboard`).
fn relay(d: &Dashboard) -> Markup {
    let Some(health) = &d.health else {
        return html! {};
    };
    let r = health.report();
    html! {
        div.panel {
            dl.fields {
                dt { "Health" }
                dd {
                    @if r.is_healthy() { span.badge.ok { "ok" } } @else { span.badge.bad { "unhealthy" } }
                }
                dt { "Circuit" }
                dd {
                    @if r.circuit_open { span.badge.bad { "open: not claiming, probing the broker" } }
                    @else { span.badge.ok { "closed" } }
                }
                dt { "Broker" }
                dd {
                    @match r.broker_reachable {
                        Some(true) => span.badge.ok { "reachable" },
                        Some(false) => span.badge.bad { "unreachable" },
                        None => span.muted { "not probed yet" },
                    }
                }
                dt { "Published by this relay" }
                dd { (thousands(r.published)) }
                @if !r.reasons.is_empty() {
                    dt { "Why" }
                    dd {
                        ul { @for reason in &r.reasons { li.error { (reason) } } }
                    }
                }
            }
        }
    }
}
