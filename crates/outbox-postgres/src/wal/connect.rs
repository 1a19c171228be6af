//! The replication connection's settings from the database URL.

use pgwire_replication::{ReplicationConfig, TlsConfig};

use super::{WalConfig, WalError};

/// A `pgwire-replication` configuration for `url` (`postgres://user:password@host:port/db`
/// with an optional `sslmode`), reading `wal`'s slot and publication from `start`.
///
/// The session runs with `DateStyle=ISO` and `TimeZone=UTC`, the text format
/// [`pgoutput`](super::pgoutput) parses.
pub(crate) fn replication_config(
    url: &str,
    wal: &WalConfig,
    start: pgwire_replication::Lsn,
) -> Result<ReplicationConfig, WalError> {
    let parsed = url::Url::parse(url).map_err(|e| WalError::Url(e.to_string()))?;
    if !matches!(parsed.scheme(), "postgres" | "postgresql") {
        return Err(WalError::Url(
            "the WAL relay needs a postgres:// URL".into(),
        ));
    }
    let decode =
        |s: &str| percent_decode(s).ok_or_else(|| WalError::Url("invalid percent-encoding".into()));
    let host = parsed.host_str().unwrap_or("localhost").to_owned();
    let user = match parsed.username() {
        "" => "postgres".to_owned(),
        u => decode(u)?,
    };
    let password = parsed
        .password()
        .map(decode)
        .transpose()?
        .unwrap_or_default();
    let database = match parsed.path().trim_start_matches('/') {
        "" => user.clone(),
        d => decode(d)?,
    };
    let sslmode = parsed
        .query_pairs()
        .find(|(k, _)| k == "sslmode")
        .map(|(_, v)| v.into_owned());
    let tls = match sslmode.as_deref() {
        None | Some("disable" | "allow" | "prefer") => TlsConfig::disabled(),
        Some("require") => TlsConfig::require(),
        Some("verify-ca") => TlsConfig::verify_ca(None),
        Some("verify-full") => TlsConfig::verify_full(None),
        Some(other) => return Err(WalError::Url(format!("unknown sslmode {other:?}"))),
    };
    Ok(ReplicationConfig::new(
        host,
        user,
        password,
        database,
        wal.slot(),
        wal.publication(),
    )
    .with_port(parsed.port().unwrap_or(5432))
    .with_tls(tls)
    .with_start_lsn(start)
    .with_status_interval(wal.status_interval)
    .with_wakeup_interval(std::time::Duration::from_secs(10))
    .with_buffer_size(4096)
    .with_options("-c DateStyle=ISO -c TimeZone=UTC")
    .with_application_name("outbox-wal-relay"))
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_map_onto_the_replication_config() {
        let wal = WalConfig::new("outbox");
        let c = replication_config(
            "postgres://app:s%40cret@db.example:6543/shop?sslmode=require",
            &wal,
            pgwire_replication::Lsn::ZERO,
        )
        .expect("config");
        assert_eq!(
            (
                c.host.as_str(),
                c.port,
                c.user.as_str(),
                c.password.as_str()
            ),
            ("db.example", 6543, "app", "s@cret")
        );
        assert_eq!(c.database, "shop");
        assert!(c.tls.mode.requires_tls());
        let c = replication_config(
            "postgres://postgres@127.0.0.1/test",
            &wal,
            pgwire_replication::Lsn::ZERO,
        )
        .expect("config");
        assert_eq!((c.port, c.password.as_str()), (5432, ""));
        assert!(replication_config("mysql://x/y", &wal, pgwire_replication::Lsn::ZERO).is_err());
        assert!(
            replication_config(
                "postgres://h/d?sslmode=bogus",
                &wal,
                pgwire_replication::Lsn::ZERO
            )
            .is_err()
        );
    }
}
