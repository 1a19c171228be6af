//! The row changes of `pgoutput` (protocol version 1, text format) that the WAL relay
//! needs: `Relation` (the column names of a table, sent before its first change in a
//! session and after every change of its definition), `Insert` and `Update`. The
//! replication client (`pgwire-replication`) decodes the transaction boundaries and
//! hands these over as raw bytes.
//!
//! Decoding never panics on its input: a truncated or unknown message is an error
//! (the stream is corrupt), a row whose values do not fit an [`OutboxMessage`] is a
//! per-row error (the row goes dead).

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use outboxkit_core::{MessageStatus, OutboxMessage};
use serde_json::value::RawValue;
use uuid::Uuid;

/// A table as `pgoutput` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Relation {
    pub(crate) oid: u32,
    pub(crate) schema: String,
    pub(crate) name: String,
    pub(crate) columns: Vec<String>,
    /// Each column's position, by name.
    index: HashMap<String, usize>,
}

/// One column value of a tuple.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Value {
    Null,
    /// A TOASTed value an `UPDATE` did not change (not sent).
    Unchanged,
    Text(String),
}

/// The messages the relay acts on; everything else is `Other`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Change {
    Relation(Relation),
    Insert {
        oid: u32,
        tuple: Vec<Value>,
    },
    /// The new tuple of an update.
    Update {
        oid: u32,
        tuple: Vec<Value>,
    },
    Other,
}

/// A malformed `pgoutput` message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed pgoutput message: {0}")]
pub(crate) struct Malformed(String);

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], Malformed> {
        if self.0.len() < n {
            return Err(Malformed(format!("truncated {what}")));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn u8(&mut self, what: &str) -> Result<u8, Malformed> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, Malformed> {
        let b = self.take(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &str) -> Result<u32, Malformed> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn cstr(&mut self, what: &str) -> Result<String, Malformed> {
        let end = self
            .0
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| Malformed(format!("unterminated {what}")))?;
        let s = String::from_utf8_lossy(&self.0[..end]).into_owned();
        self.0 = &self.0[end + 1..];
        Ok(s)
    }
    fn tuple(&mut self) -> Result<Vec<Value>, Malformed> {
        let n = self.u16("tuple column count")?;
        let mut values = Vec::with_capacity(usize::from(n));
        for _ in 0..n {
            values.push(match self.u8("tuple column kind")? {
                b'n' => Value::Null,
                b'u' => Value::Unchanged,
                b't' => {
                    let len = self.u32("value length")? as usize;
                    let bytes = self.take(len, "value")?;
                    Value::Text(String::from_utf8_lossy(bytes).into_owned())
                }
                b'b' => return Err(Malformed("binary values were not requested".into())),
                other => return Err(Malformed(format!("unknown tuple kind {other:#x}"))),
            });
        }
        Ok(values)
    }
}

/// Decodes one `XLogData` payload of the `pgoutput` stream.
pub(crate) fn decode(data: &[u8]) -> Result<Change, Malformed> {
    let mut r = Reader(data);
    match r.u8("message tag")? {
        b'R' => {
            let oid = r.u32("relation oid")?;
            let schema = r.cstr("namespace")?;
            let name = r.cstr("relation name")?;
            let _replica_identity = r.u8("replica identity")?;
            let n = r.u16("column count")?;
            let mut columns = Vec::with_capacity(usize::from(n));
            for _ in 0..n {
                let _flags = r.u8("column flags")?;
                columns.push(r.cstr("column name")?);
                let _type = r.u32("column type")?;
                let _typmod = r.u32("column typmod")?;
            }
            let index = columns
                .iter()
                .enumerate()
                .map(|(i, c)| (c.clone(), i))
                .collect();
            Ok(Change::Relation(Relation {
                oid,
                schema,
                name,
                columns,
                index,
            }))
        }
        b'I' => {
            let oid = r.u32("relation oid")?;
            match r.u8("insert tuple tag")? {
                b'N' => Ok(Change::Insert {
                    oid,
                    tuple: r.tuple()?,
                }),
                other => Err(Malformed(format!("insert: unexpected tag {other:#x}"))),
            }
        }
        b'U' => {
            let oid = r.u32("relation oid")?;
            let mut tag = r.u8("update tuple tag")?;
            if tag == b'K' || tag == b'O' {
                let _old = r.tuple()?;
                tag = r.u8("update new tuple tag")?;
            }
            match tag {
                b'N' => Ok(Change::Update {
                    oid,
                    tuple: r.tuple()?,
                }),
                other => Err(Malformed(format!("update: unexpected tag {other:#x}"))),
            }
        }
        _ => Ok(Change::Other),
    }
}

/// A tuple of the outbox table, its values by column name.
pub(crate) struct Row<'a> {
    relation: &'a Relation,
    tuple: &'a [Value],
}

impl<'a> Row<'a> {
    pub(crate) fn new(relation: &'a Relation, tuple: &'a [Value]) -> Self {
        Self { relation, tuple }
    }

    fn opt(&self, column: &str) -> Result<Option<&'a str>, String> {
        let value = self
            .relation
            .index
            .get(column)
            .and_then(|&i| self.tuple.get(i));
        match value {
            None => Err(format!("column {column} is missing")),
            Some(Value::Null) => Ok(None),
            Some(Value::Unchanged) => Err(format!("column {column} was not sent (unchanged)")),
            Some(Value::Text(s)) => Ok(Some(s.as_str())),
        }
    }

    fn text(&self, column: &str) -> Result<&'a str, String> {
        self.opt(column)?
            .ok_or_else(|| format!("column {column} is NULL"))
    }

    fn int<T: std::str::FromStr>(&self, column: &str) -> Result<T, String>
    where
        T::Err: std::fmt::Display,
    {
        let s = self.text(column)?;
        s.parse().map_err(|e| format!("{column} {s:?}: {e}"))
    }

    fn time(&self, column: &str) -> Result<Option<DateTime<Utc>>, String> {
        self.opt(column)?.map(|s| timestamp(column, s)).transpose()
    }

    /// The row's id, if it has a readable one.
    pub(crate) fn id(&self) -> Result<Uuid, String> {
        let s = self.text("id")?;
        Uuid::parse_str(s).map_err(|e| format!("id {s:?}: {e}"))
    }

    /// The row's status code.
    pub(crate) fn status(&self) -> Result<i16, String> {
        self.int("status")
    }

    /// The row as a message to publish, or why it cannot be one.
    pub(crate) fn message(&self) -> Result<OutboxMessage, String> {
        let payload = RawValue::from_string(self.text("payload")?.to_owned())
            .map_err(|e| format!("payload: {e}"))?;
        let headers: serde_json::Value =
            serde_json::from_str(self.text("headers")?).map_err(|e| format!("headers: {e}"))?;
        let headers = outboxkit_core::headers_from_json(headers)?;
        let required_time = |column: &str| {
            self.time(column)?
                .ok_or_else(|| format!("column {column} is NULL"))
        };
        Ok(OutboxMessage {
            id: self.id()?,
            seq: self.int("seq")?,
            aggregate_type: self.text("aggregate_type")?.to_owned(),
            aggregate_id: self.text("aggregate_id")?.to_owned(),
            aggregate_version: self.int("aggregate_version")?,
            event_type: self.text("event_type")?.to_owned(),
            payload,
            headers,
            tenant_id: self.opt("tenant_id")?.map(str::to_owned),
            routing_key: self.opt("routing_key")?.map(str::to_owned),
            partition_key: self.opt("partition_key")?.map(str::to_owned),
            occurred_at: required_time("occurred_at")?,
            created_at: required_time("created_at")?,
            visible_at: required_time("visible_at")?,
            attempts: self.int("attempts")?,
            status: MessageStatus::from_code(self.status()?).map_err(|e| e.to_string())?,
            last_error: self.opt("last_error")?.map(str::to_owned),
            claim_token: None,
            lease_until: self.time("lease_until")?,
            sent_at: self.time("sent_at")?,
        })
    }
}

/// A `timestamptz` in PostgreSQL's ISO output (the session runs with `DateStyle=ISO`
/// and `TimeZone=UTC`), e.g. `2026-11-28 00:41:20.123456+00`.
fn timestamp(column: &str, s: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_str(s, "%Y-%m-%d %H:%M:%S%.f%#z")
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| format!("{column} {s:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relation() -> Vec<u8> {
        let mut b = vec![b'R'];
        b.extend(16_384_u32.to_be_bytes());
        b.extend(b"s\0outbox_messages\0d");
        let cols = ["id", "status", "payload"];
        b.extend((cols.len() as u16).to_be_bytes());
        for c in cols {
            b.push(0);
            b.extend(c.as_bytes());
            b.push(0);
            b.extend(25_u32.to_be_bytes());
            b.extend((-1_i32).to_be_bytes());
        }
        b
    }

    fn text(b: &mut Vec<u8>, s: &str) {
        b.push(b't');
        b.extend((s.len() as u32).to_be_bytes());
        b.extend(s.as_bytes());
    }

    #[test]
    fn relation_insert_and_update_decode() {
        let Change::Relation(rel) = decode(&relation()).expect("relation") else {
            panic!("not a relation")
        };
        assert_eq!(rel.columns, ["id", "status", "payload"]);
        let id = Uuid::now_v7();
        let mut ins = vec![b'I'];
        ins.extend(16_384_u32.to_be_bytes());
        ins.push(b'N');
        ins.extend(3_u16.to_be_bytes());
        text(&mut ins, &id.to_string());
        text(&mut ins, "0");
        ins.push(b'n');
        let Change::Insert { oid, tuple } = decode(&ins).expect("insert") else {
            panic!("not an insert")
        };
        assert_eq!(oid, 16_384);
        let row = Row::new(&rel, &tuple);
        assert_eq!(row.id(), Ok(id));
        assert_eq!(row.status(), Ok(0));
        assert!(row.message().is_err(), "a NULL payload is the row's fault");

        let mut upd = vec![b'U'];
        upd.extend(16_384_u32.to_be_bytes());
        upd.push(b'N');
        upd.extend(3_u16.to_be_bytes());
        text(&mut upd, &id.to_string());
        text(&mut upd, "3");
        upd.push(b'u');
        assert!(matches!(decode(&upd), Ok(Change::Update { .. })));
    }

    #[test]
    fn truncated_input_is_an_error_never_a_panic() {
        let rel = relation();
        for n in 1..rel.len() {
            assert!(decode(&rel[..n]).is_err(), "{n}");
        }
        assert!(decode(&[]).is_err());
        assert_eq!(decode(b"Yanything"), Ok(Change::Other));
    }

    #[test]
    fn iso_timestamps_parse() {
        for s in [
            "2026-11-28 00:41:20.123456+00",
            "2026-11-28 00:41:20+00",
            "2026-11-28 01:41:20.5+01",
            "2026-11-28 06:11:20.5+05:30",
        ] {
            assert!(timestamp("t", s).is_ok(), "{s}");
        }
        assert!(timestamp("t", "yesterday").is_err());
    }
}
