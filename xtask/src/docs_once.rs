//! Each item once in the facade's documentation (issue 47): `outboxkit` re-exports the
//! core, the backends and the transports, and a careless re-export documents one item
//! under two paths (`outboxkit::GroupStats` and `outboxkit::admin::GroupStats`), or a
//! whole driver crate twice (`postgres::sqlx` and `mysql::sqlx`).
//!
//! Read from rustdoc's list of every item, `TARGET/doc/outboxkit/all.html` (built by
//! `cargo doc -p outboxkit --all-features --no-deps`, or by release-check's docs step):
//!
//! * **listed twice**: an item name of one kind (struct, fn, constant, …) under more
//!   than one path fails, unless [`SAME_NAME`] says the paths are different items that
//!   share a name; even then, two of its pages that read the same (declaration and
//!   documentation, links aside) are one item listed twice, and fail;
//! * **missing** (when the member crates' own docs are there, as after release-check's
//!   docs step): an item of `outboxkit-core`, a backend, a transport or `outboxkit-inbox`
//!   whose name and kind the facade lists nowhere fails, outside [`NOT_IN_FACADE`].
//!
//! `cargo xtask docs-once` builds the facade's docs and runs both checks.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

use anyhow::{Context, Result};

/// `(kind, name)`s documented under several paths of the facade that are different
/// items, with why. The kind is rustdoc's file prefix (`struct`, `fn`, `constant`, …).
/// The flag says that their pages may read the same (a constant of the same value and
/// words in two crates); otherwise two pages that read the same are one item.
pub(crate) const SAME_NAME: &[(&str, &str, bool, &str)] = &[
    (
        "constant",
        "DEFAULT_SCHEMA",
        true,
        "each SQL backend's own (postgres, mysql, sqlserver)",
    ),
    (
        "constant",
        "LATEST_VERSION",
        false,
        "each SQL backend's own migration count",
    ),
    (
        "constant",
        "DEFAULT_MAX_PAYLOAD_BYTES",
        false,
        "the outbox's (1 MiB), RabbitMQ's publish limit (16 MiB) and NATS's (none but the server's)",
    ),
    (
        "constant",
        "DEFAULT_CONFIRM_TIMEOUT",
        true,
        "each transport's own (RabbitMQ's publisher confirm, NATS's PubAck)",
    ),
    (
        "constant",
        "DEFAULT_URL",
        false,
        "each transport's local broker",
    ),
    (
        "constant",
        "DEFAULT_CONNECTION_NAME",
        false,
        "each transport's connection name",
    ),
    (
        "constant",
        "DEFAULT_CONNECT_TIMEOUT",
        false,
        "each transport's connect timeout",
    ),
    (
        "constant",
        "DEFAULT_RECONNECT_INITIAL",
        false,
        "each transport consumer's first reconnect delay",
    ),
    (
        "constant",
        "DEFAULT_RECONNECT_MAX",
        false,
        "each transport consumer's longest reconnect delay",
    ),
    (
        "fn",
        "headers_to_strings",
        false,
        "each transport's header decoding (AMQP field table, NATS header map)",
    ),
    (
        "fn",
        "redact_url",
        false,
        "the core's (any URL) and each transport's (its broker's URL forms)",
    ),
    (
        "fn",
        "parse_url",
        false,
        "each sqlx backend's URL parser (`PgConnectOptions`, `MySqlConnectOptions`)",
    ),
    (
        "fn",
        "describe",
        false,
        "the relay's metrics (`metrics`) and the consumer's (`inbox::metrics`)",
    ),
    (
        "constant",
        "DEAD_TOTAL",
        false,
        "the relay's metric name and the consumer's",
    ),
    (
        "constant",
        "DEFERRED_TOTAL",
        false,
        "the relay's metric name and the consumer's",
    ),
    (
        "constant",
        "LABEL_EVENT_TYPE",
        true,
        "the relay's metric label and the consumer's",
    ),
    (
        "constant",
        "LABEL_KIND",
        true,
        "the relay's metric label and the consumer's",
    ),
];

/// Path prefixes of the member crates' own docs that the facade does not carry, with why.
pub(crate) const NOT_IN_FACADE: &[(&str, &str)] = &[
    (
        "outboxkit_core::conformance",
        "test suites for backend authors, `outboxkit_core`'s own",
    ),
    (
        "outboxkit_core::inbox_conformance",
        "test suites for backend authors, `outboxkit_core`'s own",
    ),
    (
        "outboxkit_core::transport_conformance",
        "test suites for transport authors, `outboxkit_core`'s own",
    ),
    (
        "outboxkit_core::proptest_support",
        "test strategies shared with the transports",
    ),
    (
        "outboxkit_core::store_conformance_tests",
        "the store suite's macro",
    ),
    (
        "outboxkit_core::inbox_conformance_tests",
        "the inbox suite's macro",
    ),
    (
        "outboxkit_core::transport_conformance_tests",
        "the transport suite's macro",
    ),
    (
        "outboxkit_postgres::wal",
        "the WAL relay: the `outbox` binary's, no feature of the facade",
    ),
];

/// The member crates whose items the facade re-exports (library names).
const MEMBERS: &[&str] = &[
    "outboxkit_core",
    "outboxkit_postgres",
    "outboxkit_mysql",
    "outboxkit_sqlserver",
    "outboxkit_rabbit",
    "outboxkit_nats",
    "outboxkit_inbox",
];

/// One entry of `all.html`: rustdoc's kind (the page's file prefix), the path shown
/// (`admin::GroupStats`) and the page (relative to the crate's doc directory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Item {
    pub(crate) kind: String,
    pub(crate) path: String,
    pub(crate) page: String,
}

impl Item {
    fn name(&self) -> &str {
        self.path.rsplit("::").next().unwrap_or(&self.path)
    }
}

/// The items `all.html` lists: every `<a href="…/kind.Name.html">path</a>` of its
/// item lists.
pub(crate) fn items(all_html: &str) -> Vec<Item> {
    let body = all_html
        .find("<ul class=\"all-items\">")
        .map_or(all_html, |i| &all_html[i..]);
    let mut out = Vec::new();
    let mut rest = body;
    while let Some(i) = rest.find("<a href=\"") {
        rest = &rest[i + "<a href=\"".len()..];
        let Some(end) = rest.find('"') else { break };
        let page = &rest[..end];
        let Some(text_start) = rest.find('>') else {
            break;
        };
        let Some(text_end) = rest[text_start..].find("</a>") else {
            break;
        };
        let path = &rest[text_start + 1..text_start + text_end];
        rest = &rest[text_start + text_end..];
        let file = page.rsplit('/').next().unwrap_or(page);
        let Some(kind) = file.strip_suffix(".html").and_then(|f| f.split_once('.')) else {
            continue;
        };
        if page.starts_with('#') || page.starts_with("http") || page.starts_with("..") {
            continue;
        }
        out.push(Item {
            kind: kind.0.to_owned(),
            path: path.to_owned(),
            page: page.to_owned(),
        });
    }
    out
}

/// What a page says about its item: the declaration and the documentation, without
/// links (relative links differ with the page's depth) and without the path shown in
/// the title.
pub(crate) fn fingerprint(page_html: &str) -> String {
    let decl = section(page_html, "<pre class=\"rust item-decl\">", "</pre>");
    let docs = section(page_html, "<div class=\"docblock\">", "</details>");
    strip_tags(&format!("{decl}\n{docs}"))
}

fn section<'a>(html: &'a str, start: &str, end: &str) -> &'a str {
    let Some(i) = html.find(start) else {
        return "";
    };
    let from = &html[i..];
    from.find(end).map_or(from, |j| &from[..j])
}

fn strip_tags(html: &str) -> String {
    let mut out = String::with_capacity(html.len());
    let mut in_tag = false;
    for c in html.chars() {
        match c {
            '<' => in_tag = true,
            '>' => in_tag = false,
            c if !in_tag => out.push(c),
            _ => {}
        }
    }
    out
}

/// The `(kind, name)`s listed under more than one path that are not different items:
/// one message each. `page` reads a page of the facade's docs (relative path).
pub(crate) fn listed_twice(items: &[Item], page: impl Fn(&str) -> Option<String>) -> Vec<String> {
    let mut by_name: BTreeMap<(&str, &str), Vec<&Item>> = BTreeMap::new();
    for item in items {
        by_name
            .entry((item.kind.as_str(), item.name()))
            .or_default()
            .push(item);
    }
    let mut problems = Vec::new();
    for ((kind, name), group) in by_name {
        if group.len() < 2 {
            continue;
        }
        let paths: Vec<&str> = group.iter().map(|i| i.path.as_str()).collect();
        let allowed = SAME_NAME
            .iter()
            .find(|&&(k, n, _, _)| k == kind && n == name);
        let prints: Vec<Option<String>> = group
            .iter()
            .map(|i| page(&i.page).map(|html| fingerprint(&html)))
            .collect();
        let mut same = Vec::new();
        for (a, pa) in prints.iter().enumerate() {
            for (b, pb) in prints.iter().enumerate().skip(a + 1) {
                if let (Some(pa), Some(pb)) = (pa, pb)
                    && pa == pb
                {
                    same.push(format!("{} = {}", paths[a], paths[b]));
                }
            }
        }
        if allowed.is_none() {
            problems.push(format!(
                "{kind} {name} is listed under {} paths: {}{}",
                group.len(),
                paths.join(", "),
                if same.is_empty() {
                    " (their pages differ: if they are different items, add the name to \
                     xtask's docs_once::SAME_NAME)"
                        .to_owned()
                } else {
                    format!(" (the same item: {})", same.join("; "))
                }
            ));
        } else if !same.is_empty()
            && allowed.is_some_and(|&(_, _, may_read_same, _)| !may_read_same)
        {
            problems.push(format!(
                "{kind} {name}: allowed as different items sharing a name, but these pages \
                 are one item listed twice: {}",
                same.join("; ")
            ));
        }
    }
    problems
}

/// The member crates' items (from their own `all.html`) whose kind and name the facade
/// lists nowhere, outside [`NOT_IN_FACADE`]; `members` maps a crate to its items.
pub(crate) fn missing(facade: &[Item], members: &BTreeMap<String, Vec<Item>>) -> Vec<String> {
    let listed: BTreeSet<(&str, &str)> =
        facade.iter().map(|i| (i.kind.as_str(), i.name())).collect();
    let mut problems = Vec::new();
    for (krate, items) in members {
        for item in items {
            let full = format!("{krate}::{}", item.path);
            if NOT_IN_FACADE
                .iter()
                .any(|&(prefix, _)| full == prefix || full.starts_with(&format!("{prefix}::")))
            {
                continue;
            }
            if !listed.contains(&(item.kind.as_str(), item.name())) {
                problems.push(format!(
                    "{} {full} is in no path of the facade's docs (add it to a list of \
                     crates/outbox/src/lib.rs, or to xtask's docs_once::NOT_IN_FACADE)",
                    item.kind
                ));
            }
        }
    }
    problems
}

/// Both checks on the docs under `doc_dir` (`TARGET/doc`); the member crates' docs are
/// compared when present. Returns the problems, none when the facade lists each item
/// once.
pub(crate) fn check(doc_dir: &Path) -> Result<Vec<String>> {
    let facade_dir = doc_dir.join("outboxkit");
    let all = fs::read_to_string(facade_dir.join("all.html")).with_context(|| {
        format!(
            "{}: build it with `cargo doc -p outboxkit --all-features --no-deps`",
            facade_dir.join("all.html").display()
        )
    })?;
    let facade = items(&all);
    if facade.is_empty() {
        anyhow::bail!("{}: no items found", facade_dir.join("all.html").display());
    }
    let mut problems = listed_twice(&facade, |page| {
        fs::read_to_string(facade_dir.join(page)).ok()
    });
    let mut members = BTreeMap::new();
    for krate in MEMBERS {
        if let Ok(html) = fs::read_to_string(doc_dir.join(krate).join("all.html")) {
            members.insert((*krate).to_owned(), items(&html));
        }
    }
    problems.extend(missing(&facade, &members));
    eprintln!(
        "xtask: docs-once: {} items in the facade's docs; compared with the docs of {} \
         member crates ({})",
        facade.len(),
        members.len(),
        members.keys().cloned().collect::<Vec<_>>().join(", ")
    );
    Ok(problems)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: &str = r#"<h1>All</h1><ul class="all-items">
        <li><a href="struct.GroupStats.html">GroupStats</a></li>
        <li><a href="admin/struct.GroupStats.html">admin::GroupStats</a></li>
        <li><a href="postgres/constant.LATEST_VERSION.html">postgres::LATEST_VERSION</a></li>
        <li><a href="mysql/constant.LATEST_VERSION.html">mysql::LATEST_VERSION</a></li>
        <li><a href="fn.sanitize_error.html">sanitize_error</a></li>
        </ul>"#;

    fn page(decl: &str, docs: &str) -> String {
        format!(
            "<h1>x</h1><pre class=\"rust item-decl\"><code>{decl}</code></pre>\
             <details class=\"toggle top-doc\"><div class=\"docblock\"><p>{docs}</p></div></details>"
        )
    }

    #[test]
    fn all_html_items_are_read_with_kind_path_and_page() {
        let items = items(ALL);
        assert_eq!(items.len(), 5);
        assert_eq!(
            items[1],
            Item {
                kind: "struct".into(),
                path: "admin::GroupStats".into(),
                page: "admin/struct.GroupStats.html".into(),
            }
        );
    }

    #[test]
    fn an_item_under_two_paths_fails_and_allowed_different_items_pass() {
        let items = items(ALL);
        let problems = listed_twice(&items, |p| {
            Some(match p {
                "postgres/constant.LATEST_VERSION.html" => page("const A: &str", "PostgreSQL's"),
                "mysql/constant.LATEST_VERSION.html" => page("const A: &str", "MySQL's"),
                _ => page("pub struct <a href=\"x\">GroupStats</a>", "Stats."),
            })
        });
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].contains("struct GroupStats is listed under 2 paths")
                && problems[0].contains("the same item"),
            "{problems:?}"
        );
    }

    #[test]
    fn an_allowed_name_whose_pages_read_the_same_is_one_item_listed_twice() {
        let items = items(ALL);
        let problems = listed_twice(&items, |_| Some(page("const A: &str", "Same.")));
        assert!(
            problems
                .iter()
                .any(|p| p.contains("LATEST_VERSION: allowed") && p.contains("listed twice")),
            "{problems:?}"
        );
    }

    #[test]
    fn a_member_item_the_facade_lists_nowhere_is_missing_unless_exempt() {
        let facade = items(ALL);
        let mut members = BTreeMap::new();
        members.insert(
            "outboxkit_core".to_owned(),
            items(
                r#"<ul class="all-items">
                <li><a href="struct.GroupStats.html">GroupStats</a></li>
                <li><a href="fn.lost.html">lost</a></li>
                <li><a href="conformance/trait.Harness.html">conformance::Harness</a></li>
                </ul>"#,
            ),
        );
        let problems = missing(&facade, &members);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].contains("fn outboxkit_core::lost"),
            "{problems:?}"
        );
    }
}
