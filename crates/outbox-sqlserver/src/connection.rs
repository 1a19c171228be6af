//! Connections: a bb8 [`ManageConnection`](bb8::ManageConnection) for tiberius over
//! tokio, the [`MssqlPool`] the stores share, and [`MssqlTransaction`], a pooled
//! connection with an open transaction (tiberius has no transaction object of its own).

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use outboxkit_core::OutboxError;
use tokio::net::TcpStream;
use tokio_util::compat::{Compat, TokioAsyncWriteCompatExt};

use crate::error::{ConnectError, db};

/// The tiberius client this crate works with: TDS over a tokio TCP stream.
pub type MssqlClient = tiberius::Client<Compat<TcpStream>>;

/// Session options set on every new connection: the ANSI settings that filtered indexes
/// and indexed computed columns require for any write to the table (tiberius logs in
/// as an ODBC client, which sets most of them already), `XACT_ABORT ON` so that a
/// failed statement rolls back its whole transaction instead of leaving it half-done,
/// and `NOCOUNT OFF` against a server whose `user options` turn row counts off (the
/// statements whose counts matter read `@@ROWCOUNT` or `OUTPUT` rows anyway).
pub(crate) const SESSION_SETUP: &str = "SET ANSI_NULLS, ANSI_PADDING, ANSI_WARNINGS, ARITHABORT, \
    CONCAT_NULL_YIELDS_NULL, QUOTED_IDENTIFIER ON; SET NUMERIC_ROUNDABORT OFF; SET XACT_ABORT ON; \
    SET NOCOUNT OFF;";

/// How [`MssqlTransaction::rollback`] ends a transaction: a T-SQL batch, not a TDS
/// transaction-manager request, so that a transaction `XACT_ABORT` already rolled back
/// (`@@TRANCOUNT` is 0) is a no-op instead of error 3903. The server reports the
/// rollback, when there is one, with the same environment change as for the request, so
/// the client's transaction state follows either way.
pub(crate) const ROLLBACK_IF_OPEN: &str = "IF @@TRANCOUNT > 0 ROLLBACK TRANSACTION;";

/// How [`MssqlTransaction::commit`] ends a transaction: one T-SQL batch (a plain SQL
/// batch, not `sp_executesql`, whose end would raise error 266 for a changed
/// `@@TRANCOUNT`) that commits only a transaction that can commit and says what it
/// found, in `state`:
///
/// - `1`: the transaction was live and is now committed; every level of it, should the
///   caller have left a nested `BEGIN TRANSACTION` open (a nested level is only a
///   counter: one `COMMIT` would leave the transaction open on a connection going back
///   to the pool);
/// - `0`: there was no transaction left to commit. Under `XACT_ABORT ON` (this crate's
///   session setting) a failed statement rolls the whole transaction back at once, so
///   this is a transaction an earlier statement's error aborted, whose error its caller
///   caught and went on (or, rarer, one the caller ended itself with `ROLLBACK` or
///   `COMMIT`);
/// - `-1`: the transaction was doomed (an error caught inside `TRY ... CATCH`, or with
///   `XACT_ABORT OFF` an error that dooms anyway) and can only be rolled back, which the
///   batch does. The server rolls back a transaction still doomed when a batch ends
///   (with error 3998 if no error was sent yet), so this is not expected at the start
///   of a batch; it is handled anyway.
///
/// `SET XACT_ABORT ON` comes first: a caller may have turned it off on the session, and
/// with it on a failing `COMMIT` ends the batch instead of going round the loop again.
pub(crate) const COMMIT_IF_COMMITTABLE: &str = "SET XACT_ABORT ON;
DECLARE @state int = XACT_STATE();
IF @state = 1
BEGIN
    WHILE @@TRANCOUNT > 0 COMMIT TRANSACTION;
END
ELSE IF @state = -1
    ROLLBACK TRANSACTION;
SELECT @state AS state;";

/// A pooled connection: the client plus a flag saying whether it may be reused.
///
/// The flag is raised while this crate has a statement or a transaction in flight on
/// the connection and lowered when that work finished cleanly. A connection returned to
/// the pool with the flag raised (a dropped future, an error, a
/// [`MssqlTransaction`] dropped without commit or rollback) is discarded, so the server
/// rolls back whatever it held and no later borrower inherits an open transaction.
#[derive(Debug)]
pub struct MssqlConnection {
    client: MssqlClient,
    in_flight: bool,
}

impl MssqlConnection {
    /// Marks the connection busy (discarded if returned before [`settle`](Self::settle)).
    pub(crate) fn start(&mut self) {
        self.in_flight = true;
    }

    /// Marks the connection clean again.
    pub(crate) fn settle(&mut self) {
        self.in_flight = false;
    }
}

impl Deref for MssqlConnection {
    type Target = MssqlClient;
    fn deref(&self) -> &MssqlClient {
        &self.client
    }
}

impl DerefMut for MssqlConnection {
    fn deref_mut(&mut self) -> &mut MssqlClient {
        &mut self.client
    }
}

/// Opens tiberius connections for bb8: TCP (nodelay), TLS with rustls, login, one
/// redirect when the server routes the client elsewhere (Azure SQL gateways), then
/// the session options (`XACT_ABORT ON` and the ANSI settings that writes to tables
/// with filtered indexes and indexed computed columns require).
#[derive(Debug, Clone)]
pub struct MssqlConnectionManager {
    config: tiberius::Config,
    connect_timeout: Duration,
}

impl MssqlConnectionManager {
    /// A manager for `config`; each connect (TCP, TLS and login together) may take at
    /// most `connect_timeout`.
    pub fn new(config: tiberius::Config, connect_timeout: Duration) -> Self {
        Self {
            config,
            connect_timeout,
        }
    }

    /// Opens one connection.
    ///
    /// # Errors
    /// [`ConnectError`] naming the address and the cause.
    pub async fn open(&self) -> Result<MssqlConnection, ConnectError> {
        let addr = self.config.get_addr();
        match tokio::time::timeout(self.connect_timeout, self.open_at(self.config.clone())).await {
            Ok(result) => result,
            Err(_) => Err(ConnectError::Timeout {
                addr,
                timeout: self.connect_timeout,
            }),
        }
    }

    async fn open_at(&self, config: tiberius::Config) -> Result<MssqlConnection, ConnectError> {
        let addr = config.get_addr();
        let client = match Self::login(config.clone(), &addr).await {
            Err(ConnectError::Login {
                source: tiberius::error::Error::Routing { host, port },
                ..
            }) => {
                let mut routed = config;
                routed.host(&host);
                routed.port(port);
                let addr = routed.get_addr();
                Self::login(routed, &addr).await?
            }
            other => other?,
        };
        let mut conn = MssqlConnection {
            client,
            in_flight: false,
        };
        let setup = async {
            conn.client
                .simple_query(SESSION_SETUP)
                .await?
                .into_results()
                .await
        };
        setup
            .await
            .map_err(|source| ConnectError::Login { addr, source })?;
        Ok(conn)
    }

    async fn login(config: tiberius::Config, addr: &str) -> Result<MssqlClient, ConnectError> {
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(|source| ConnectError::Unreachable {
                addr: addr.to_owned(),
                source,
            })?;
        // Best effort: without nodelay small requests wait for delayed ACKs.
        let _ = tcp.set_nodelay(true);
        tiberius::Client::connect(config, tcp.compat_write())
            .await
            .map_err(|source| ConnectError::Login {
                addr: addr.to_owned(),
                source,
            })
    }
}

impl bb8::ManageConnection for MssqlConnectionManager {
    type Connection = MssqlConnection;
    type Error = ConnectError;

    async fn connect(&self) -> Result<MssqlConnection, ConnectError> {
        self.open().await
    }

    async fn is_valid(&self, conn: &mut MssqlConnection) -> Result<(), ConnectError> {
        let addr = self.config.get_addr();
        let ping = async {
            conn.client
                .simple_query("SELECT 1")
                .await?
                .into_results()
                .await
        };
        ping.await
            .map(|_| ())
            .map_err(|source| ConnectError::Broken { addr, source })
    }

    fn has_broken(&self, conn: &mut MssqlConnection) -> bool {
        conn.in_flight
    }
}

/// The connection pool shared by [`MssqlOutbox`](crate::MssqlOutbox) and
/// [`MssqlInbox`](crate::MssqlInbox). Cheap to clone.
///
/// A connection is checked with `SELECT 1` when borrowed (bb8's default, one short
/// round trip), so connections broken by a server restart are replaced instead of
/// failing the next claim; one that failed or was abandoned mid-statement is discarded
/// when it comes back (see [`MssqlConnection`]).
#[derive(Debug, Clone)]
pub struct MssqlPool {
    inner: bb8::Pool<MssqlConnectionManager>,
    acquire_timeout: Duration,
}

/// A connection borrowed from an [`MssqlPool`]; dereferences to [`MssqlClient`].
pub type PooledConnection = bb8::PooledConnection<'static, MssqlConnectionManager>;

impl MssqlPool {
    pub(crate) fn new(inner: bb8::Pool<MssqlConnectionManager>, acquire_timeout: Duration) -> Self {
        Self {
            inner,
            acquire_timeout,
        }
    }

    /// Builds a pool around an existing bb8 pool (e.g. one configured differently);
    /// `acquire_timeout` is only used in error messages.
    pub fn from_bb8(inner: bb8::Pool<MssqlConnectionManager>, acquire_timeout: Duration) -> Self {
        Self::new(inner, acquire_timeout)
    }

    /// The underlying bb8 pool.
    pub fn bb8(&self) -> &bb8::Pool<MssqlConnectionManager> {
        &self.inner
    }

    /// Borrows a connection (for the caller's own statements, e.g. a transaction that
    /// enqueues with `MssqlOutbox`'s
    /// [`enqueue`](outboxkit_core::OutboxProducer::enqueue)).
    ///
    /// A connection handed back with a transaction still open stays open on the server
    /// for the next borrower: end every `BEGIN TRAN` with `COMMIT` or `ROLLBACK`, or use
    /// [`begin`](Self::begin), which discards a connection whose transaction was not
    /// ended.
    ///
    /// ```no_run
    /// use outboxkit_core::OutboxProducer;
    /// # async fn demo(
    /// #     outbox: &outboxkit_sqlserver::MssqlOutbox,
    /// #     event: &outboxkit_core::NewMessage,
    /// # ) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut conn = outbox.pool().get().await?;
    /// conn.simple_query("BEGIN TRAN").await?.into_results().await?;
    /// let work = async {
    ///     conn.execute("INSERT INTO dbo.orders (id) VALUES (@P1)", &[&42_i64])
    ///         .await?;
    ///     outbox.enqueue(&mut conn, event).await?;
    ///     Ok::<_, Box<dyn std::error::Error>>(())
    /// }
    /// .await;
    /// let end = if work.is_ok() { "COMMIT" } else { "IF @@TRANCOUNT > 0 ROLLBACK" };
    /// conn.simple_query(end).await?.into_results().await?;
    /// work
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`OutboxError::Database`] (`Unavailable`) when no connection can be opened or
    /// none becomes free within the acquire timeout.
    pub async fn get(&self) -> Result<PooledConnection, OutboxError> {
        self.inner
            .get_owned()
            .await
            .map_err(crate::error::pool("acquire", self.acquire_timeout))
    }

    /// Borrows a connection and marks it in flight (see [`MssqlConnection`]); the
    /// caller settles it once its statement finished cleanly.
    pub(crate) async fn checkout(
        &self,
        operation: &'static str,
    ) -> Result<PooledConnection, OutboxError> {
        let mut conn = self
            .inner
            .get_owned()
            .await
            .map_err(crate::error::pool(operation, self.acquire_timeout))?;
        conn.start();
        Ok(conn)
    }

    /// Runs `sql` with `params` on a pooled connection and collects every row of every
    /// result set.
    pub(crate) async fn rows(
        &self,
        operation: &'static str,
        sql: &str,
        params: &[&dyn tiberius::ToSql],
    ) -> Result<Vec<tiberius::Row>, OutboxError> {
        let mut conn = self.checkout(operation).await?;
        let results = conn
            .query(sql, params)
            .await
            .map_err(db(operation))?
            .into_results()
            .await
            .map_err(db(operation))?;
        conn.settle();
        Ok(results.into_iter().flatten().collect())
    }

    /// Runs `sql` (whose last row has a bigint column `affected`, the rows it changed)
    /// with `params`; returns that count.
    pub(crate) async fn affected(
        &self,
        operation: &'static str,
        sql: &str,
        params: &[&dyn tiberius::ToSql],
    ) -> Result<u64, OutboxError> {
        let rows = self.rows(operation, sql, params).await?;
        let count = rows
            .last()
            .map(|row| row.try_get::<i64, _>("affected"))
            .transpose()
            .map_err(db(operation))?
            .flatten()
            .unwrap_or(0);
        Ok(u64::try_from(count).unwrap_or(0))
    }

    /// Borrows a connection and begins a transaction on it (a TDS transaction-manager
    /// request, the same as `BEGIN TRANSACTION`).
    ///
    /// # Errors
    /// [`OutboxError::Database`] when no connection can be had or the server refuses.
    pub async fn begin(&self) -> Result<MssqlTransaction, OutboxError> {
        let mut conn = self.checkout("begin").await?;
        conn.client.begin_transaction().await.map_err(db("begin"))?;
        Ok(MssqlTransaction { conn })
    }

    /// Borrows a connection and runs `batch`, a plain T-SQL batch that begins a
    /// transaction (and may set the session up for it: the inbox's).
    pub(crate) async fn begin_with(
        &self,
        operation: &'static str,
        batch: &str,
    ) -> Result<MssqlTransaction, OutboxError> {
        let mut conn = self.checkout(operation).await?;
        conn.client
            .simple_query(batch)
            .await
            .map_err(db(operation))?
            .into_results()
            .await
            .map_err(db(operation))?;
        Ok(MssqlTransaction { conn })
    }
}

/// A pooled connection with an open transaction. Dereferences to [`MssqlClient`], so
/// statements run inside the transaction: `tx.execute(...)`, `outbox.enqueue(&mut tx,
/// ...)`.
///
/// End it with [`commit`](Self::commit) or [`rollback`](Self::rollback). Dropped
/// without either, its connection is closed instead of being returned to the pool, and
/// the server rolls the transaction back. [`commit`](Self::commit) commits only a
/// transaction that can still commit and reports one a failed statement aborted as
/// [`OutboxError::TransactionAborted`].
#[derive(Debug)]
pub struct MssqlTransaction {
    conn: PooledConnection,
}

impl MssqlTransaction {
    /// Commits, if the transaction can still commit; the connection goes back to the
    /// pool.
    ///
    /// One plain batch reads `XACT_STATE()` and commits only a live transaction (every
    /// level of it: a nested `BEGIN TRANSACTION` left open inside it is committed with
    /// it), else rolls back a doomed one, and says which it found. A transaction an
    /// earlier failed statement already aborted (under this crate's `XACT_ABORT ON`,
    /// the server rolled it back at once; a doomed one is rolled back now) is reported
    /// as [`OutboxError::TransactionAborted`]: none of its statements committed, and
    /// the caller must not act as if they had (e.g. acknowledge a message).
    ///
    /// Statements sent after the abort, and before this commit, ran outside any
    /// transaction (autocommit) and are not undone: with `XACT_ABORT ON` a failed
    /// statement's error ends the transaction, so do not go on after one.
    ///
    /// # Errors
    /// [`OutboxError::TransactionAborted`] as above (the connection is clean and goes
    /// back to the pool); [`OutboxError::Database`] when the commit itself fails; the
    /// transaction's effects are then not durable (the connection is discarded and the
    /// server rolls back).
    pub async fn commit(self) -> Result<(), OutboxError> {
        self.commit_with(COMMIT_IF_COMMITTABLE, "commit").await
    }

    /// [`commit`](Self::commit) with `batch`, a plain batch that ends the
    /// transaction as [`COMMIT_IF_COMMITTABLE`] does and answers `state` the same way,
    /// naming `operation` in its errors.
    pub(crate) async fn commit_with(
        mut self,
        batch: &str,
        operation: &'static str,
    ) -> Result<(), OutboxError> {
        let rows = self
            .conn
            .client
            .simple_query(batch)
            .await
            .map_err(db(operation))?
            .into_results()
            .await
            .map_err(db(operation))?;
        let state = rows
            .into_iter()
            .flatten()
            .next()
            .map(|row| row.try_get::<i32, _>("state"))
            .transpose()
            .map_err(db(operation))?
            .flatten();
        match state {
            Some(1) => {
                self.conn.settle();
                Ok(())
            }
            // Rolled back already, or just now: no transaction is left open on the
            // connection, so it may be reused.
            Some(0 | -1) => {
                self.conn.settle();
                Err(OutboxError::TransactionAborted { operation })
            }
            // Not this batch's answer: the connection is discarded (still in flight),
            // so the server rolls back whatever might be open.
            _ => Err(db(operation)(tiberius::error::Error::Protocol(
                format!("the commit batch returned state {state:?}, not 1, 0 or -1").into(),
            ))),
        }
    }

    /// Rolls back with `IF @@TRANCOUNT > 0 ROLLBACK TRANSACTION` (a no-op when `XACT_ABORT`
    /// already ended the transaction); the connection goes back to the pool.
    ///
    /// A transaction the server already ended is rolled back as far as the caller is
    /// concerned, and this returns `Ok`: under `XACT_ABORT ON` (this crate's session
    /// default) a failed statement, e.g. a handler's, has already rolled the whole
    /// transaction back, and a plain `ROLLBACK` would then fail with error 3903 ("no
    /// corresponding BEGIN TRANSACTION").
    ///
    /// # Errors
    /// [`OutboxError::Database`] when the statement itself fails (a broken connection);
    /// the connection is then discarded, so the server rolls back anything left.
    pub async fn rollback(self) -> Result<(), OutboxError> {
        self.rollback_with(ROLLBACK_IF_OPEN, "rollback").await
    }

    /// [`rollback`](Self::rollback) with `batch`, a plain batch that ends the
    /// transaction as [`ROLLBACK_IF_OPEN`] does, naming `operation` in its errors.
    pub(crate) async fn rollback_with(
        mut self,
        batch: &str,
        operation: &'static str,
    ) -> Result<(), OutboxError> {
        self.conn
            .client
            .simple_query(batch)
            .await
            .map_err(db(operation))?
            .into_results()
            .await
            .map_err(db(operation))?;
        self.conn.settle();
        Ok(())
    }
}

impl Deref for MssqlTransaction {
    type Target = MssqlClient;
    fn deref(&self) -> &MssqlClient {
        &self.conn.client
    }
}

impl DerefMut for MssqlTransaction {
    fn deref_mut(&mut self) -> &mut MssqlClient {
        &mut self.conn.client
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rollback_of_an_aborted_transaction_is_a_no_op() {
        // Under XACT_ABORT ON the server has already rolled back after a failed
        // statement; a bare ROLLBACK (or a TM rollback request) would fail with 3903.
        assert_eq!(ROLLBACK_IF_OPEN, "IF @@TRANCOUNT > 0 ROLLBACK TRANSACTION;");
        assert!(SESSION_SETUP.contains("SET XACT_ABORT ON;"));
    }

    #[test]
    fn commit_commits_only_a_committable_transaction_and_says_what_it_found() {
        let lines: Vec<&str> = COMMIT_IF_COMMITTABLE.lines().map(str::trim).collect();
        assert_eq!(
            lines,
            [
                // A failing COMMIT ends the batch, whatever the caller set.
                "SET XACT_ABORT ON;",
                // Read once, before anything changes it.
                "DECLARE @state int = XACT_STATE();",
                // Live: commit, every nesting level (a nested level is only a counter).
                "IF @state = 1",
                "BEGIN",
                "WHILE @@TRANCOUNT > 0 COMMIT TRANSACTION;",
                "END",
                // Doomed: it can only be rolled back. 0: XACT_ABORT already rolled it back.
                "ELSE IF @state = -1",
                "ROLLBACK TRANSACTION;",
                // The caller maps 0 and -1 to TransactionAborted.
                "SELECT @state AS state;",
            ]
        );
        // No parameters: it runs as a plain batch (`simple_query`), not through
        // sp_executesql, whose end would raise error 266 for the changed @@TRANCOUNT.
        assert!(!COMMIT_IF_COMMITTABLE.contains("@P"));
    }
}
