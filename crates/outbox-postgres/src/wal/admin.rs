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
/// SQLSTATE `42704` (`undefined_object`): the slot does not exist; from the stream, a
/// publication missing at some change.
pub(crate) const UNDEFINED_OBJECT: &str = "42704";
/// SQLSTATE `58P01` (`undefined_file`): from the stream, WAL the slot needs is gone.
pub(crate) const UNDEFINED_FILE: &str = "58P01";
/// SQLSTATE `55000` (`object_not_in_prerequisite_state`): from the stream, a slot that
/// cannot be read (invalidated, another database's, a standby's).
pub(crate) const NOT_IN_PREREQUISITE_STATE: &str = "55000";

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
    /// What the publication lacks for the relay (see [`PublicationGap`]); `None` when
    /// it covers the outbox table's inserts and updates, or does not exist.
    pub publication_gap: Option<String>,
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

/// The slot's row of `pg_replication_slots`. Its `failover` and `invalidation_reason`
/// columns (PostgreSQL 17) and `conflicting` (16) are read through `to_jsonb` so that
/// the statement also runs on earlier servers (NULL). `invalidation` is PostgreSQL
/// 17's reason code (`wal_removed`, `rows_removed`, `wal_level_insufficient`, ...),
/// before 17 `wal_removed` for `wal_status = 'lost'` and `rows_removed` for a
/// conflicting slot; NULL for a usable slot.
async fn slot_row(pool: &PgPool, slot: &str) -> Result<Option<sqlx::postgres::PgRow>, WalError> {
    Ok(sqlx::query(
        "SELECT plugin::text AS plugin, active_pid, confirmed_flush_lsn::text AS confirmed, \
         (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint AS retained, wal_status, \
         (to_jsonb(s) ->> 'failover')::bool AS failover, \
         coalesce(to_jsonb(s) ->> 'invalidation_reason', \
                  CASE WHEN wal_status = 'lost' THEN 'wal_removed' END, \
                  CASE WHEN (to_jsonb(s) ->> 'conflicting')::bool THEN 'rows_removed' END) \
           AS invalidation \
         FROM pg_replication_slots s WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
    .map_err(db("wal slot"))?)
}

/// [`WalError::SlotInvalidated`] when the slot's `row` (from [`slot_row`]) says that
/// PostgreSQL invalidated it.
fn require_valid(row: Option<&sqlx::postgres::PgRow>, slot: &str) -> Result<(), WalError> {
    let Some(code) = slot_column::<String>(row, "invalidation")? else {
        return Ok(());
    };
    let why = match code.as_str() {
        "wal_removed" => {
            "it retained more WAL than max_slot_wal_keep_size allows, and a checkpoint removed WAL it still needed"
        }
        "rows_removed" => "rows it still needed were vacuumed",
        "wal_level_insufficient" => "wal_level was set below logical",
        "idle_timeout" => "it was not read for longer than idle_replication_slot_timeout",
        _ => "",
    };
    Err(WalError::SlotInvalidated {
        slot: slot.to_owned(),
        reason: if why.is_empty() {
            code
        } else {
            format!("{code}: {why}")
        },
    })
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

/// How a publication falls short of what the WAL relay needs of it: every insert and
/// update of the outbox table (an update back to `New` is a replayed dead letter), with
/// all its columns. A relay reading a publication with a gap would confirm the slot's
/// position past rows it never receives.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PublicationGap {
    /// The outbox table is not in it: not listed, not in a schema it publishes
    /// (`FOR TABLES IN SCHEMA`), and the publication is not `FOR ALL TABLES`.
    TableMissing,
    /// Its `publish` parameter leaves out inserts or updates.
    Operations {
        /// What it publishes, as `publish` lists it (e.g. `insert`).
        publishes: String,
    },
    /// A row filter on the table (PostgreSQL 15): rows it leaves out are never sent.
    RowFilter {
        /// The filter, as `pg_publication_tables.rowfilter` shows it.
        filter: String,
    },
    /// A column list on the table (PostgreSQL 15) without these columns.
    Columns {
        /// The columns left out.
        missing: Vec<String>,
    },
}

impl std::fmt::Display for PublicationGap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TableMissing => f.write_str("the table is not in it"),
            Self::Operations { publishes } => {
                let has = |op: &str| publishes.split(", ").any(|p| p == op);
                let missing = match (has("insert"), has("update")) {
                    (true, _) => "updates",
                    (false, true) => "inserts",
                    (false, false) => "inserts and updates",
                };
                write!(f, "publish = '{publishes}' leaves out {missing}")
            }
            Self::RowFilter { filter } => write!(f, "its row filter {filter} leaves rows out"),
            Self::Columns { missing } => {
                write!(f, "its column list leaves out {}", missing.join(", "))
            }
        }
    }
}

/// Whether `wal`'s publication exists (`None`: it does not) and what it lacks for
/// `outbox`'s table (`Some(None)`: nothing). The optional columns of
/// `pg_publication_tables` (`rowfilter`, `attnames`: PostgreSQL 15) are read through
/// `to_jsonb`, NULL before 15.
async fn publication(
    outbox: &PgOutbox,
    wal: &WalConfig,
) -> Result<Option<Option<PublicationGap>>, WalError> {
    let row = sqlx::query(
        "SELECT p.pubinsert, p.pubupdate, p.pubdelete, p.pubtruncate, \
         t.pubname IS NOT NULL AS covered, to_jsonb(t) ->> 'rowfilter' AS row_filter, \
         ARRAY(SELECT a.attname::text FROM pg_attribute a \
               WHERE a.attrelid = to_regclass($3) AND a.attnum > 0 AND NOT a.attisdropped \
                 AND a.attgenerated = '' \
                 AND NOT coalesce((to_jsonb(t) -> 'attnames') ? a.attname::text, true) \
               ORDER BY a.attnum) AS missing_columns \
         FROM pg_publication p \
         LEFT JOIN pg_publication_tables t \
           ON t.pubname = p.pubname AND t.schemaname = $2 AND t.tablename = 'outbox_messages' \
         WHERE p.pubname = $1",
    )
    .bind(wal.publication())
    .bind(outbox.schema())
    .bind(format!(
        "{}.outbox_messages",
        quoted_schema(outbox.schema())
    ))
    .fetch_optional(outbox.pool())
    .await
    .map_err(db("wal publication"))?;
    let Some(row) = row else {
        return Ok(None);
    };
    let get = |col: &str| -> Result<bool, WalError> {
        Ok(row.try_get(col).map_err(db("wal publication"))?)
    };
    let gap = if !get("covered")? {
        Some(PublicationGap::TableMissing)
    } else if !(get("pubinsert")? && get("pubupdate")?) {
        let publishes: Vec<&str> = [
            ("insert", get("pubinsert")?),
            ("update", get("pubupdate")?),
            ("delete", get("pubdelete")?),
            ("truncate", get("pubtruncate")?),
        ]
        .into_iter()
        .filter_map(|(op, on)| on.then_some(op))
        .collect();
        Some(PublicationGap::Operations {
            publishes: publishes.join(", "),
        })
    } else if let Some(filter) = row
        .try_get::<Option<String>, _>("row_filter")
        .map_err(db("wal publication"))?
    {
        Some(PublicationGap::RowFilter { filter })
    } else {
        let missing: Vec<String> = row
            .try_get("missing_columns")
            .map_err(db("wal publication"))?;
        (!missing.is_empty()).then_some(PublicationGap::Columns { missing })
    };
    Ok(Some(gap))
}

/// [`WalError::PublicationMissing`] or [`WalError::PublicationIncomplete`] unless
/// `found` ([`publication`]'s answer) is a publication that covers the inserts and
/// updates of `outbox`'s table.
fn require_publication(
    outbox: &PgOutbox,
    wal: &WalConfig,
    found: Option<Option<PublicationGap>>,
) -> Result<(), WalError> {
    match found {
        Some(None) => Ok(()),
        Some(Some(gap)) => Err(WalError::PublicationIncomplete {
            publication: wal.publication().to_owned(),
            table: format!("{}.outbox_messages", outbox.schema()),
            gap,
        }),
        None => Err(WalError::PublicationMissing {
            publication: wal.publication().to_owned(),
        }),
    }
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

/// The slot as [`preflight`] found it.
pub(crate) struct Slot {
    /// The position confirmed by the relay.
    pub(crate) confirmed: Option<String>,
    /// The walsender reading it, if any.
    pub(crate) active_pid: Option<i32>,
    /// WAL it retains, in bytes.
    pub(crate) retained: Option<i64>,
}

/// The slot, checked for the relay: `wal_level = logical`, the slot exists, it is
/// `pgoutput`, PostgreSQL has not invalidated it, and the publication covers the
/// outbox table's inserts and updates.
pub(crate) async fn preflight(outbox: &PgOutbox, wal: &WalConfig) -> Result<Slot, WalError> {
    wal.validate()?;
    let pool = outbox.pool();
    require_logical(pool).await?;
    let Some(row) = slot_row(pool, wal.slot()).await? else {
        return Err(WalError::SlotMissing {
            slot: wal.slot().to_owned(),
        });
    };
    let column = |col: &str| slot_column::<String>(Some(&row), col);
    let plugin = column("plugin")?;
    if plugin.as_deref() != Some("pgoutput") {
        return Err(WalError::WrongPlugin {
            slot: wal.slot().to_owned(),
            plugin: plugin.unwrap_or_default(),
        });
    }
    require_valid(Some(&row), wal.slot())?;
    require_publication(outbox, wal, publication(outbox, wal).await?)?;
    Ok(Slot {
        confirmed: column("confirmed")?,
        active_pid: slot_column(Some(&row), "active_pid")?,
        retained: slot_column(Some(&row), "retained")?,
    })
}

/// Checks what the relay needs before it reads: `wal_level = logical`, the slot (a
/// `pgoutput` slot that PostgreSQL has not invalidated) and the publication (covering
/// the outbox table's inserts and updates).
///
/// # Errors
/// [`WalError::InvalidName`] ([`WalConfig::validate`], before any query),
/// [`WalError::WalLevel`], [`WalError::SlotMissing`], [`WalError::WrongPlugin`],
/// [`WalError::SlotInvalidated`], [`WalError::PublicationMissing`],
/// [`WalError::PublicationIncomplete`], [`WalError::Store`].
pub async fn check(outbox: &PgOutbox, wal: &WalConfig) -> Result<(), WalError> {
    preflight(outbox, wal).await.map(drop)
}

/// What a failure `e` of the replication stream means. The server's refusals that no
/// retry helps (SQLSTATE `42704`, `55000`, `58P01`) are looked into: the slot and the
/// publication as [`preflight`] finds them now (the slot gone or invalidated, the
/// publication gone or incomplete), else [`WalError::WalRemoved`] for `58P01` and
/// [`WalError::PublicationRecreated`] for `42704` (the publication is there now, but
/// was not at a change the slot must still decode). Any other failure is returned as
/// it is, as is a preflight that cannot run (the server restarting: retried).
pub(crate) async fn explain(outbox: &PgOutbox, wal: &WalConfig, e: WalError) -> WalError {
    let Some(code) = e
        .sqlstate()
        .filter(|c| [UNDEFINED_OBJECT, UNDEFINED_FILE, NOT_IN_PREREQUISITE_STATE].contains(c))
    else {
        return e;
    };
    let code = code.to_owned();
    if let Err(found) = preflight(outbox, wal).await {
        return found;
    }
    let WalError::Stream(pgwire_replication::PgWireError::Server(server)) = e else {
        return e;
    };
    match code.as_str() {
        UNDEFINED_FILE => WalError::WalRemoved {
            slot: wal.slot().to_owned(),
            server,
        },
        UNDEFINED_OBJECT => WalError::PublicationRecreated {
            slot: wal.slot().to_owned(),
            publication: wal.publication().to_owned(),
            server,
        },
        _ => WalError::Stream(pgwire_replication::PgWireError::Server(server)),
    }
}

/// The state of `wal`'s slot and publication.
///
/// # Errors
/// [`WalError::InvalidName`] ([`WalConfig::validate`], before any query),
/// [`WalError::Store`] when a query fails.
pub async fn status(outbox: &PgOutbox, wal: &WalConfig) -> Result<SlotStatus, WalError> {
    wal.validate()?;
    let pool = outbox.pool();
    let level = wal_level(pool).await?;
    let row = slot_row(pool, wal.slot()).await?;
    let row = row.as_ref();
    let publication = publication(outbox, wal).await?;
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
        publication_exists: publication.is_some(),
        publication_gap: publication.flatten().map(|gap| gap.to_string()),
        notify_trigger_enabled: trigger_enabled(outbox).await?,
    })
}

/// Creates the publication (on the outbox table, inserts and updates: an update back
/// to `New` is a replayed dead letter), then the slot (`pgoutput`; after the
/// publication, so that the slot's first change already sees it; a failover slot with
/// [`WalConfig::with_failover`]), and disables the polling relay's NOTIFY trigger (the
/// producers' commit cost it exists for). Each step is skipped when already done.
///
/// An existing publication is checked, never changed: it may serve others, and
/// changing it would not bring back the rows a slot already decoded without them. One
/// that does not cover the table's inserts and updates is refused, as is a slot
/// PostgreSQL invalidated, or a slot whose publication is missing (made now, the slot
/// could not decode the changes written before): the error says how to fix it or start
/// over.
///
/// # Errors
/// [`WalError::InvalidName`] ([`WalConfig::validate`], before any query);
/// [`WalError::WalLevel`] unless `wal_level = logical`; with
/// [`WalConfig::with_failover`], [`WalError::FailoverUnsupported`] before PostgreSQL 17
/// and [`WalError::FailoverOff`] when the slot exists without it;
/// [`WalError::SlotInvalidated`], [`WalError::PublicationIncomplete`],
/// [`WalError::PublicationMissing`] (a slot without its publication): all before
/// anything is created; [`WalError::Store`].
pub async fn setup(outbox: &PgOutbox, wal: &WalConfig) -> Result<SetupReport, WalError> {
    wal.validate()?;
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
    require_valid(existing.as_ref(), wal.slot())?;
    // An existing publication must cover the table's inserts and updates; one missing
    // under an existing slot cannot be made again: the slot would not decode the
    // changes written meanwhile (see `explain`). Both refused before anything is made.
    let publication_created = match publication(outbox, wal).await? {
        None if existing.is_none() => {
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
        }
        found => {
            require_publication(outbox, wal, found)?;
            false
        }
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
/// [`WalError::InvalidName`] ([`WalConfig::validate`], before any query),
/// [`WalError::SlotActive`], [`WalError::Store`].
pub async fn drop_slot(outbox: &PgOutbox, wal: &WalConfig, force: bool) -> Result<bool, WalError> {
    wal.validate()?;
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
