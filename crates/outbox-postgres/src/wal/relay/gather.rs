//! The changes gathered for the next batch ([`Gathered`]): whole messages for ordinary
//! transactions, row ids only for a transaction larger than a part (see
//! [`WalRelayConfig::with_part_size`](super::WalRelayConfig::with_part_size)).

use std::collections::HashMap;

use pgwire_replication::Lsn;
use uuid::Uuid;

use super::session::Item;

/// What the stream gathered since the last batch went out, in commit order.
///
/// Rows of ordinary transactions are kept as decoded from the stream (`items`), with
/// an index by id so that an `Update` finds its row at once. A transaction that grows
/// past `part_size` rows keeps only its rows' ids (`large`, 16 bytes a row, the
/// messages it had gathered turned into ids): its rows are read back from the table in
/// parts when it is published, as committed (an update later in the transaction
/// included, a deleted row gone), so that the relay's memory does not grow with the
/// transaction's payloads.
pub(super) struct Gathered {
    pub(super) items: Vec<Item>,
    /// Where each row of `items` is, by id.
    index: HashMap<Uuid, usize>,
    /// The transactions of the items (see `flush`), without repeats in a row.
    pub(super) xids: Vec<u32>,
    /// The ids of the last transaction's rows once it is larger than a part, in commit
    /// order (an id may repeat: an update after its insert; the later one is a no-op,
    /// see `WalRelay::flush_gathered`).
    pub(super) large: Vec<Uuid>,
    /// Where the transaction being received (the last one received) starts in `items`.
    tx_start: usize,
    /// The end of the transaction before the last one: the position confirmed once the
    /// items before `tx_start` are handled (a large transaction's parts confirm no more).
    pub(super) before_tx: Option<Lsn>,
    part_size: usize,
}

impl Gathered {
    pub(super) fn new(part_size: usize) -> Self {
        Self {
            items: Vec::new(),
            index: HashMap::new(),
            xids: Vec::new(),
            large: Vec::new(),
            tx_start: 0,
            before_tx: None,
            part_size: part_size.max(1),
        }
    }

    /// Rows gathered (a large transaction's ids included).
    pub(super) fn len(&self) -> usize {
        self.items.len() + self.large.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.items.is_empty() && self.large.is_empty()
    }

    /// Whether the batch goes out now that no transaction is open: `batch_size` rows
    /// gathered, or a large transaction (never held with the next one).
    pub(super) fn full(&self, batch_size: usize) -> bool {
        self.len() >= batch_size || !self.large.is_empty()
    }

    /// A transaction begins; `last_commit` is the end of the one before it.
    pub(super) fn begin(&mut self, last_commit: Option<Lsn>) {
        // A large transaction is always the last one gathered: the batch goes out at
        // its commit (it is past the batch size), before the next one begins.
        debug_assert!(self.large.is_empty());
        self.tx_start = self.items.len();
        self.before_tx = last_commit;
    }

    /// `item`, a row of transaction `xid`, in commit order.
    pub(super) fn push(&mut self, item: Item, xid: u32) {
        if self.xids.last() != Some(&xid) {
            self.xids.push(xid);
        }
        if !self.large.is_empty() {
            self.large.push(item.id());
            return;
        }
        self.index.insert(item.id(), self.items.len());
        self.items.push(item);
        if self.items.len() - self.tx_start > self.part_size {
            // The transaction is larger than a part: from now on, ids only.
            self.large.reserve(self.part_size * 2);
            for item in self.items.drain(self.tx_start..) {
                let id = item.id();
                self.index.remove(&id);
                self.large.push(id);
            }
        }
    }

    /// An update of row `id` in transaction `xid`, back to (or still) `New` when
    /// `pending`: a row gathered is read back from the table when it is published, as
    /// committed; another pending row (a replayed dead letter) is gathered to be read
    /// back. O(1).
    pub(super) fn update(&mut self, id: Uuid, pending: bool, xid: u32) {
        if let Some(&at) = self.index.get(&id) {
            // Updated after it was read and before it was published (in the same
            // transaction: an ORM setting a column after its insert): the row is read
            // from the table when the batch is published, as committed. (Not from this
            // tuple: a column stored out of line and left unchanged is not in it.)
            self.items[at] = Item::Replay(id);
            if self.xids.last() != Some(&xid) {
                self.xids.push(xid);
            }
        } else if pending {
            // A replayed dead letter; in a large transaction also a row of it, read
            // back as committed anyway: gathered again, it is published once (the
            // later one finds it published, see `WalRelay::flush_gathered`).
            self.push(Item::Replay(id), xid);
        }
    }

    /// Everything gathered, leaving it empty.
    pub(super) fn take(&mut self) -> Self {
        let empty = Self::new(self.part_size);
        std::mem::replace(self, empty)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn poison(id: Uuid) -> Item {
        Item::Poison {
            id,
            reason: "x".into(),
        }
    }

    #[test]
    fn an_update_of_a_gathered_row_reads_it_back_in_place() {
        let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
        let mut g = Gathered::new(10);
        g.begin(None);
        g.push(poison(a), 1);
        g.push(poison(b), 1);
        g.update(a, true, 1);
        // Not gathered and no longer pending: nothing to do.
        g.update(c, false, 1);
        assert_eq!(g.len(), 2);
        assert!(matches!(g.items[0], Item::Replay(id) if id == a));
        // Not gathered and pending (a replayed dead letter): read back after the rest.
        g.update(c, true, 2);
        assert!(matches!(g.items[2], Item::Replay(id) if id == c));
        assert_eq!(g.xids, [1, 2]);
    }

    #[test]
    fn a_transaction_past_a_part_keeps_ids_only() {
        let earlier = Uuid::new_v4();
        let ids: Vec<Uuid> = (0..5).map(|_| Uuid::new_v4()).collect();
        let mut g = Gathered::new(3);
        g.begin(None);
        g.push(poison(earlier), 1);
        let end = "0/10".parse::<Lsn>().expect("lsn");
        g.begin(Some(end));
        for id in &ids[..3] {
            g.push(poison(*id), 2);
        }
        assert!(g.large.is_empty(), "a part's worth is held whole");
        assert!(!g.full(100));
        g.push(poison(ids[3]), 2);
        assert_eq!(
            g.items.len(),
            1,
            "the earlier transaction's row stays whole"
        );
        assert_eq!(g.large, ids[..4]);
        g.push(poison(ids[4]), 2);
        // An update of a row of the transaction gathers it again; the earlier
        // transaction's row is read back in place.
        g.update(ids[0], true, 2);
        g.update(earlier, true, 2);
        assert!(matches!(g.items[0], Item::Replay(id) if id == earlier));
        assert_eq!(g.large.len(), 6);
        assert_eq!(g.len(), 7);
        assert!(g.full(100), "a large transaction goes out at its commit");
        assert_eq!(g.before_tx, Some(end));
        let taken = g.take();
        assert_eq!(taken.large.len(), 6);
        assert!(g.is_empty());
    }
}
