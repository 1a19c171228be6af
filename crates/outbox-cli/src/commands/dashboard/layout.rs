//! The page shell (navigation, mode, database), the embedded assets and the
//! formatting helpers every page uses. Every value goes through maud's escaping; the
//! only `PreEscaped` text is the shell's own constant markup.

use std::time::Duration;

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, html};
use outboxkit_core::MessageStatus;

use super::Dashboard;

/// The stylesheet, compiled in.
const CSS: &str = include_str!("assets/dashboard.css");
/// The live-refresh script, compiled in.
const JS: &str = include_str!("assets/dashboard.js");

/// `GET /assets/dashboard.css`
pub(crate) async fn css() -> Response {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], CSS).into_response()
}

/// `GET /assets/dashboard.js`
pub(crate) async fn js() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        JS,
    )
        .into_response()
}

/// The navigation entries: path, label, and the key [`page`] marks as current.
const NAV: [(&str, &str, &str); 6] = [
    ("/", "Overview", "overview"),
    ("/messages?state=pending", "Pending", "pending"),
    ("/messages?state=dead", "Dead letters", "dead"),
    ("/messages?state=sent", "Sent", "sent"),
    ("/blocked", "Blocked keys", "blocked"),
    ("/inbox", "Consumer dead letters", "inbox"),
];

/// A whole page: `title`, the navigation with `current` marked, and `body`.
pub(crate) fn page(d: &Dashboard, current: &str, title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · outbox" }
                link rel="stylesheet" href="/assets/dashboard.css";
                script src="/assets/dashboard.js" defer {}
            }
            body {
                header.top {
                    a.brand href="/" { "outbox" }
                    nav {
                        @for (href, label, key) in NAV {
                            a href=(href) class=[(key == current).then_some("current")] { (label) }
                        }
                    }
                    span.meta {
                        span.db { (d.database) }
                        @if d.allow_replay {
                            span.mode.write { "replay enabled" }
                        } @else {
                            span.mode { "read-only" }
                        }
                    }
                }
                main {
                    h1 { (title) }
                    (body)
                }
            }
        }
    }
}

/// A minimal page for errors (no navigation state needed).
pub(crate) fn error_page(status: StatusCode, message: &str) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                title { (status.as_u16()) " · outbox" }
                link rel="stylesheet" href="/assets/dashboard.css";
            }
            body {
                main {
                    h1 { (status.as_u16()) " " (status.canonical_reason().unwrap_or("")) }
                    p.error { (message) }
                    p { a href="/" { "Overview" } }
                }
            }
        }
    }
}

/// A time as `2025-01-31 12:00:00Z`, or `-`.
pub(crate) fn time(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(
        || "-".to_owned(),
        |t| t.format("%Y-%m-%d %H:%M:%SZ").to_string(),
    )
}

/// A duration as `4s`, `3m 20s`, `2h 5m`, `3d 4h`, or `-`.
pub(crate) fn age(d: Option<Duration>) -> String {
    let Some(d) = d else { return "-".to_owned() };
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86_400 => format!("{}h {}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {}h", s / 86_400, (s % 86_400) / 3600),
    }
}

/// A count bounded at `bound`: `≥ bound` when it reached it.
pub(crate) fn bounded(n: u64, bound: u64) -> String {
    if n >= bound {
        format!("≥ {}", thousands(bound))
    } else {
        thousands(n)
    }
}

/// `1234567` as `1,234,567`.
pub(crate) fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// At most `max` characters on one line (control characters as spaces), `…` when cut.
pub(crate) fn short(text: Option<&str>, max: usize) -> String {
    crate::output::short(text, max)
}

/// A status as a badge.
pub(crate) fn status(s: MessageStatus) -> Markup {
    let (class, label) = match s {
        MessageStatus::New => ("new", "New"),
        MessageStatus::Processing => ("processing", "Processing"),
        MessageStatus::Sent => ("sent", "Sent"),
        MessageStatus::Dead => ("dead", "Dead"),
    };
    html! { span class={"badge " (class)} { (label) } }
}

/// JSON text re-indented for reading, keys in their stored order (the text is
/// re-spaced, never re-parsed into a map). Text that is not JSON comes back as it is.
pub(crate) fn pretty_json(text: &str) -> String {
    if serde_json::from_str::<serde::de::IgnoredAny>(text).is_err() {
        return text.to_owned();
    }
    let mut out = String::with_capacity(text.len() * 2);
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    let newline = |out: &mut String, depth: usize| {
        out.push('\n');
        out.extend(std::iter::repeat_n("  ", depth));
    };
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if in_string {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
            continue;
        }
        match c {
            '"' => {
                in_string = true;
                out.push(c);
            }
            '{' | '[' => {
                out.push(c);
                // Skip whitespace to see whether the container is empty.
                while chars.peek().is_some_and(|c| c.is_whitespace()) {
                    chars.next();
                }
                if matches!(chars.peek(), Some('}' | ']')) {
                    if let Some(close) = chars.next() {
                        out.push(close);
                    }
                } else {
                    depth += 1;
                    newline(&mut out, depth);
                }
            }
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                newline(&mut out, depth);
                out.push(c);
            }
            ',' => {
                out.push(c);
                newline(&mut out, depth);
            }
            ':' => out.push_str(": "),
            c if c.is_whitespace() => {}
            c => out.push(c),
        }
    }
    out
}

/// Whether a header's value may be a secret, so the pages show `***` instead: names
/// holding `authorization`, `cookie`, `token`, `secret`, `password`, `passwd`,
/// `api-key`/`api_key`/`apikey`, `signature` or `credential` (ASCII case-insensitive).
pub(crate) fn is_secret_header(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    [
        "authorization",
        "cookie",
        "token",
        "secret",
        "password",
        "passwd",
        "api-key",
        "api_key",
        "apikey",
        "signature",
        "credential",
    ]
    .iter()
    .any(|s| n.contains(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_is_reindented_in_stored_key_order() {
        let text = r#"{"z":1,"a":[1, 2,{}],"s":"x,{y}:\"q\"","e":[]}"#;
        assert_eq!(
            pretty_json(text),
            "{\n  \"z\": 1,\n  \"a\": [\n    1,\n    2,\n    {}\n  ],\n  \"s\": \"x,{y}:\\\"q\\\"\",\n  \"e\": []\n}"
        );
        assert_eq!(pretty_json("not json {"), "not json {");
        assert_eq!(pretty_json("\"<script>\""), "\"<script>\"");
        assert_eq!(pretty_json("42"), "42");
    }

    #[test]
    fn numbers_ages_and_secrets_format() {
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(thousands(999), "999");
        assert_eq!(bounded(10_000, 10_000), "≥ 10,000");
        assert_eq!(bounded(12, 10_000), "12");
        assert_eq!(age(Some(Duration::from_secs(200))), "3m 20s");
        assert_eq!(age(Some(Duration::from_secs(7300))), "2h 1m");
        assert_eq!(age(None), "-");
        for secret in [
            "Authorization",
            "x-api-key",
            "session_token",
            "DB_PASSWORD",
            "Cookie",
        ] {
            assert!(is_secret_header(secret), "{secret}");
        }
        for plain in ["traceparent", "ce-type", "content-type", "x-tenant"] {
            assert!(!is_secret_header(plain), "{plain}");
        }
    }

    #[test]
    fn interpolated_text_is_escaped() {
        let hostile = "<script>window.__pwned = 1</script>";
        let markup =
            html! { p { (hostile) } pre { (pretty_json(&format!("{{\"x\":\"{hostile}\"}}"))) } };
        let text = markup.into_string();
        assert!(!text.contains("<script>"), "{text}");
        assert!(text.contains("&lt;script&gt;window.__pwned = 1&lt;/script&gt;"));
    }
}
