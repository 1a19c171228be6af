//! The slot and the publication: `outbox wal setup|status|drop`, and the checks the
//! relay runs before it reads.

use std::time::Duration;

use serde::Serialize;
use sqlx::{AssertSqlSafe, PgPool, Row as _};

use super::{WalConfig, WalError};
use crate::PgOutbox;
use crate::error::db;
use crate::sql::quoted_schema;

/// The notification trigger of migrations 7 and 9 (the polling relay's wake-up).
const NOTIFY_TRIGGER: &str = "outbox_messages_notify";

/// SQLSTATE `55006` (`object_in_use`): the slot is active for another session.
pub(crate) const OBJECT_IN_USE: &str = "55006";
/// SQLSTATE `42704` (`undefined_object`): the slot does not exist.
pub(crate) const UNDEFINED_OBJECT: &str = "42704";

/// The server's `wal_level` (`minimal`, `replica` or `logical`).
///
/// # Errors
/// [`WalError::Store`] when the query fails.
pub async fn wal_level(pool: &PgPool) -> Result<String, WalError> {
    Ok(sqlx::query_scalar("SELECT current_setting('wal_level')")
        .fetch_one(pool)
        .await
        .map_err(db("wal_level"))?)
}

/// [`WalError::WalLevel`] unless `wal_level` is `logical`.
pub(crate) async fn require_logical(pool: &PgPool) -> Result<(), WalError> {
    let actual = wal_level(pool).await?;
    if actual == "logical" {
        Ok(())
    } else {
        Err(WalError::WalLevel { actual })
    }
}

/// What `outbox wal status` shows: the slot, its position, the WAL it retains.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct SlotStatus {
    /// The server's `wal_level`.
    pub wal_level: String,
    /// The slot's name.
    pub slot: String,
    /// Whether the slot exists.
    pub slot_exists: bool,
    /// Its output plugin (`pgoutput`).
    pub plugin: Option<String>,
    /// The walsender reading it (the active relay's session), if any.
    pub active_pid: Option<i32>,
    /// The position confirmed by the relay: everything committed before it was
    /// published and confirmed by the broker.
    pub confirmed_flush_lsn: Option<String>,
    /// WAL the slot keeps on the server's disk, in bytes
    /// (`pg_current_wal_lsn() - confirmed_flush_lsn`).
    pub retained_bytes: Option<i64>,
    /// PostgreSQL's `wal_status` of the slot (`reserved`, `extended`, `unreserved`,
    /// `lost`).
    pub wal_status: Option<String>,
    /// Whether the slot is a failover slot, copied to standbys that synchronize slots
    /// (`None`: no slot, or a server before PostgreSQL 17, which has none).
    pub failover: Option<bool>,
    /// The publication's name.
    pub publication: String,
    /// Whether the publication exists.
    pub publication_exists: bool,
    /// Whether the polling relay's NOTIFY trigger is enabled on the outbox table
    /// (`None`: no such trigger).
    pub notify_trigger_enabled: Option<bool>,
}

/// What `outbox wal setup` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct SetupReport {
    /// The publication was created now (else it existed).
    pub publication_created: bool,
    /// The slot was created now (else it existed).
    pub slot_created: bool,
    /// Whether the slot is a failover slot (`None`: a server before PostgreSQL 17).
    pub failover: Option<bool>,
    /// The NOTIFY trigger was disabled now.
    pub notify_trigger_disabled: bool,
    /// Messages pending in the table (New or Processing). When the slot was just
    /// created they were committed before it, so the WAL relay will not see them: let
    /// the polling relay drain them first.
    pub pending_in_table: i64,
}

/// The slot's row of `pg_replication_slots`. Its `failover` column (PostgreSQL 17) is
/// read through `to_jsonb` so that the statement also runs on earlier servers (NULL).
async fn slot_row(pool: &PgPool, slot: &str) -> Result<Option<sqlx::postgres::PgRow>, WalError> {
    Ok(sqlx::query(
        "SELECT plugin::text AS plugin, active_pid, confirmed_flush_lsn::text AS confirmed, \
         (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint AS retained, wal_status, \
         (to_jsonb(s) ->> 'failover')::bool AS failover \
         FROM pg_replication_slots s WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
    .map_err(db("wal slot"))?)
}

/// Column `col` of the slot's row from [`slot_row`] (`None`: no slot, or NULL).
fn slot_column<T>(row: Option<&sqlx::postgres::PgRow>, col: &str) -> Result<Option<T>, WalError>
where
    T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    match row {
        Some(r) => Ok(r.try_get(col).map_err(db("wal slot"))?),
        None => Ok(None),
    }
}

async fn publication_exists(pool: &PgPool, publication: &str) -> Result<bool, WalError> {
    Ok(
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
            .bind(publication)
            .fetch_one(pool)
            .await
            .map_err(db("wal publication"))?,
    )
}

async fn trigger_enabled(outbox: &PgOutbox) -> Result<Option<bool>, WalError> {
    let table = format!("{}.outbox_messages", quoted_schema(outbox.schema()));
    let state: Option<String> = sqlx::query_scalar(
        "SELECT tgenabled::text FROM pg_trigger \
         WHERE tgrelid = to_regclass($1) AND tgname = $2",
    )
    .bind(table)
    .bind(NOTIFY_TRIGGER)
    .fetch_optional(outbox.pool())
    .await
    .map_err(db("wal trigger"))?;
    Ok(state.map(|s| s != "D"))
}

async fn set_trigger(outbox: &PgOutbox, enable: bool) -> Result<(), WalError> {
    let sql = format!(
        "ALTER TABLE {}.outbox_messages {} TRIGGER {NOTIFY_TRIGGER}",
        quoted_schema(outbox.schema()),
        if enable { "ENABLE" } else { "DISABLE" }
    );
    sqlx::query(AssertSqlSafe(sql))
        .execute(outbox.pool())
        .await
        .map_err(db("wal trigger"))?;
    Ok(())
}

/// The slot, checked for the relay: it exists, it is `pgoutput`, and the publication
/// exists. Returns the confirmed position and the reading session, if any.
pub(crate) async fn preflight(
    pool: &PgPool,
    wal: &WalConfig,
) -> Result<(Option<String>, Option<i32>), WalError> {
    require_logical(pool).await?;
    let Some(row) = slot_row(pool, wal.slot()).await? else {
        return Err(WalError::SlotMissing {
            slot: wal.slot().to_owned(),
        });
    };
    let plugin: Option<String> = row.try_get("plugin").map_err(db("wal slot"))?;
    if plugin.as_deref() != Some("pgoutput") {
        return Err(WalError::WrongPlugin {
            slot: wal.slot().to_owned(),
            plugin: plugin.unwrap_or_default(),
        });
    }
    if !publication_exists(pool, wal.publication()).await? {
        return Err(WalError::PublicationMissing {
            publication: wal.publication().to_owned(),
        });
    }
    Ok((
        row.try_get("confirmed").map_err(db("wal slot"))?,
        row.try_get("active_pid").map_err(db("wal slot"))?,
    ))
}

/// Checks what the relay needs before it reads: `wal_level = logical`, the slot (a
/// `pgoutput` slot) and the publication.
///
/// # Errors
/// [`WalError::WalLevel`], [`WalError::SlotMissing`], [`WalError::WrongPlugin`],
/// [`WalError::PublicationMissing`], [`WalError::Store`].
pub async fn check(outbox: &PgOutbox, wal: &WalConfig) -> Result<(), WalError> {
    preflight(outbox.pool(), wal).await.map(drop)
}

/// WAL retained by the slot, in bytes (`None`: no slot).
pub(crate) async fn retained_bytes(pool: &PgPool, slot: &str) -> Result<Option<i64>, WalError> {
    slot_column(slot_row(pool, slot).await?.as_ref(), "retained")
}

/// The state of `wal`'s slot and publication.
///
/// # Errors
/// [`WalError::Store`] when a query fails.
pub async fn status(outbox: &PgOutbox, wal: &WalConfig) -> Result<SlotStatus, WalError> {
    let pool = outbox.pool();
    let level = wal_level(pool).await?;
    let row = slot_row(pool, wal.slot()).await?;
    let row = row.as_ref();
    Ok(SlotStatus {
        wal_level: level,
        slot: wal.slot().to_owned(),
        slot_exists: row.is_some(),
        plugin: slot_column(row, "plugin")?,
        active_pid: slot_column(row, "active_pid")?,
        confirmed_flush_lsn: slot_column(row, "confirmed")?,
        retained_bytes: slot_column(row, "retained")?,
        wal_status: slot_column(row, "wal_status")?,
        failover: slot_column(row, "failover")?,
        publication: wal.publication().to_owned(),
        publication_exists: publication_exists(pool, wal.publication()).await?,
        notify_trigger_enabled: trigger_enabled(outbox).await?,
    })
}

/// Creates the publication (on the outbox table, inserts and updates: an update back
/// to `New` is a replayed dead letter), then the slot (`pgoutput`; after the
/// publication, so that the slot's first change already sees it; a failover slot with
/// [`WalConfig::with_failover`]), and disables the polling relay's NOTIFY trigger (the
/// producers' commit cost it exists for). Each step is skipped when already done.
///
/// # Errors
/// [`WalError::WalLevel`] unless `wal_level = logical`; with
/// [`WalConfig::with_failover`], [`WalError::FailoverUnsupported`] before PostgreSQL 17
/// and [`WalError::FailoverOff`] when the slot exists without it (both before anything
/// is created); [`WalError::Store`].
pub async fn setup(outbox: &PgOutbox, wal: &WalConfig) -> Result<SetupReport, WalError> {
    let pool = outbox.pool();
    require_logical(pool).await?;
    let existing = slot_row(pool, wal.slot()).await?;
    if wal.failover() {
        let (version_num, server_version): (i32, String) = sqlx::query_as(
            "SELECT current_setting('server_version_num')::int, current_setting('server_version')",
        )
        .fetch_one(pool)
        .await
        .map_err(db("wal setup"))?;
        if version_num < 170_000 {
            return Err(WalError::FailoverUnsupported { server_version });
        }
        if existing.is_some() && slot_column::<bool>(existing.as_ref(), "failover")? != Some(true) {
            return Err(WalError::FailoverOff {
                slot: wal.slot().to_owned(),
            });
        }
    }
    let publication_created = if publication_exists(pool, wal.publication()).await? {
        false
    } else {
        let sql = format!(
            "CREATE PUBLICATION {} FOR TABLE {}.outbox_messages WITH (publish = 'insert, update')",
            wal.publication(),
            quoted_schema(outbox.schema())
        );
        sqlx::query(AssertSqlSafe(sql))
            .execute(pool)
            .await
            .map_err(db("wal setup publication"))?;
        true
    };
    let slot_created = if existing.is_some() {
        false
    } else {
        // PostgreSQL 17's signature: (slot_name, plugin, temporary, twophase, failover).
        let create = if wal.failover() {
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
        } else {
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')"
        };
        sqlx::query(create)
            .bind(wal.slot())
            .execute(pool)
            .await
            .map_err(db("wal setup slot"))?;
        true
    };
    // The slot's setting: read again only when it was created now.
    let failover = if slot_created {
        slot_column(slot_row(pool, wal.slot()).await?.as_ref(), "failover")?
    } else {
        slot_column(existing.as_ref(), "failover")?
    };
    let notify_trigger_disabled = if trigger_enabled(outbox).await? == Some(true) {
        set_trigger(outbox, false).await?;
        true
    } else {
        false
    };
    let pending_in_table: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {}.outbox_messages WHERE status IN (0, 9)",
        quoted_schema(outbox.schema())
    )))
    .fetch_one(pool)
    .await
    .map_err(db("wal setup"))?;
    Ok(SetupReport {
        publication_created,
        slot_created,
        failover,
        notify_trigger_disabled,
        pending_in_table,
    })
}

/// Drops the slot and the publication and enables the NOTIFY trigger again. A slot
/// being read is refused ([`WalError::SlotActive`]) unless `force`: then its reader's
/// session is terminated first (a running relay stops with
/// [`WalError::SlotMissing`]). Returns whether the slot existed.
///
/// # Errors
/// [`WalError::SlotActive`], [`WalError::Store`].
pub async fn drop_slot(outbox: &PgOutbox, wal: &WalConfig, force: bool) -> Result<bool, WalError> {
    let pool = outbox.pool();
    let mut existed = false;
    for _ in 0..50 {
        let Some(row) = slot_row(pool, wal.slot()).await? else {
            break;
        };
        existed = true;
        let active: Option<i32> = row.try_get("active_pid").map_err(db("wal slot"))?;
        if let Some(pid) = active {
            if !force {
                return Err(WalError::SlotActive {
                    slot: wal.slot().to_owned(),
                    pid,
                });
            }
            sqlx::query("SELECT pg_terminate_backend($1)")
                .bind(pid)
                .execute(pool)
                .await
                .map_err(db("wal drop"))?;
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        match sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(wal.slot())
            .execute(pool)
            .await
        {
            Ok(_) => break,
            // Taken again (a relay reconnecting) or dropped by someone else meanwhile:
            // look again.
            Err(sqlx::Error::Database(e))
                if matches!(e.code().as_deref(), Some(OBJECT_IN_USE | UNDEFINED_OBJECT)) =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(db("wal drop")(e).into()),
        }
    }
    if let Some(row) = slot_row(pool, wal.slot()).await?
        && let Some(pid) = row
            .try_get::<Option<i32>, _>("active_pid")
            .map_err(db("wal slot"))?
    {
        return Err(WalError::SlotActive {
            slot: wal.slot().to_owned(),
            pid,
        });
    }
    sqlx::query(AssertSqlSafe(format!(
        "DROP PUBLICATION IF EXISTS {}",
        wal.publication()
    )))
    .execute(pool)
    .await
    .map_err(db("wal drop publication"))?;
    if trigger_enabled(outbox).await? == Some(false) {
        set_trigger(outbox, true).await?;
    }
    Ok(existed)
}
