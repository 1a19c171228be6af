//! The outboxkit-core store conformance suite, run against [`MemoryOutbox`].

use std::sync::Arc;

use async_trait::async_trait;
use outboxkit_core::conformance::Harness;
use outboxkit_core::{NewMessage, OutboxProducer, SentRetention};
use outboxkit_memory::MemoryOutbox;
use uuid::Uuid;

/// A fresh table per test.
struct MemoryHarness {
    store: MemoryOutbox,
}

#[async_trait]
impl Harness for MemoryHarness {
    type Store = MemoryOutbox;

    fn store(&self) -> Arc<MemoryOutbox> {
        Arc::new(self.store.clone())
    }

    fn store_deleting_sent(&self) -> Arc<MemoryOutbox> {
        Arc::new(
            self.store
                .clone()
                .with_sent_retention(SentRetention::Delete),
        )
    }

    async fn enqueue(&self, messages: &[NewMessage]) {
        let mut tx = self.store.begin();
        self.store
            .enqueue_batch(&mut tx, messages)
            .await
            .expect("enqueue");
        tx.commit().expect("commit");
    }

    async fn set_headers_json(&self, id: Uuid, json: &str) {
        assert!(self.store.set_headers_json(id, json), "message {id} exists");
    }
}

async fn harness() -> MemoryHarness {
    MemoryHarness {
        store: MemoryOutbox::new(),
    }
}

outboxkit_core::store_conformance_tests!(harness);
