//! Connection failures are typed errors that never show the password. The unreachable
//! case needs no server; the bad-credentials case needs `MSSQL_URL` (ignored without it).

mod common;

use std::time::Duration;

use outboxkit_core::{ErrorKind, OutboxError};
use outboxkit_sqlserver::{ConnectError, MssqlConfig, MssqlOutbox};

#[tokio::test]
async fn an_unreachable_server_is_an_unavailable_database_error() {
    // Port 1 on the loopback: nothing listens there, the connect is refused at once.
    let config = MssqlConfig::new("server=tcp:127.0.0.1,1;user=sa;password=hunter2")
        .with_connect_timeout(Duration::from_secs(5));
    let err = MssqlOutbox::connect(&config)
        .await
        .expect_err("nothing listens on port 1");
    let shown = format!("{err} / {err:?}");
    assert!(!shown.contains("hunter2"), "password leaked: {shown}");
    match &err {
        OutboxError::Database {
            kind,
            operation,
            source,
        } => {
            assert_eq!(*kind, ErrorKind::Unavailable);
            assert_eq!(*operation, "connect");
            let source = source
                .downcast_ref::<ConnectError>()
                .expect("a ConnectError source");
            assert!(
                matches!(source, ConnectError::Unreachable { addr, .. } if addr == "127.0.0.1:1"),
                "{source:?}"
            );
        }
        other => panic!("expected a database error, got {other:?}"),
    }
    assert!(err.kind().is_retryable());
}

#[tokio::test]
async fn a_malformed_connection_string_is_a_config_error() {
    let err = MssqlOutbox::connect(&MssqlConfig::new("user=sa;password=hunter2"))
        .await
        .expect_err("no server");
    assert!(matches!(err, OutboxError::Config(_)), "{err:?}");
    assert!(!err.to_string().contains("hunter2"));
    let err = MssqlOutbox::connect(
        &MssqlConfig::new("server=tcp:127.0.0.1,1433").with_schema("Bad-Name"),
    )
    .await
    .expect_err("bad schema");
    assert!(matches!(err, OutboxError::Config(_)), "{err:?}");
}

#[tokio::test]
#[ignore = "needs MSSQL_URL"]
async fn bad_credentials_are_a_permanent_login_error() {
    let url = common::mssql_url();
    let wrong = format!("{url};password=definitely-wrong-9");
    let err = MssqlOutbox::connect(&MssqlConfig::new(wrong))
        .await
        .expect_err("wrong password");
    assert!(!err.to_string().contains("definitely-wrong-9"));
    match &err {
        OutboxError::Database { kind, source, .. } => {
            assert_eq!(*kind, ErrorKind::Permanent, "{err}");
            assert!(
                matches!(
                    source.downcast_ref::<ConnectError>(),
                    Some(ConnectError::Login { .. })
                ),
                "{err:?}"
            );
        }
        other => panic!("expected a database error, got {other:?}"),
    }
}
