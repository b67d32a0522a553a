//! Waking the requests that wait in corral's queue when something changes that could change
//! where they go: per model for a slot freed or a model loaded or unloaded there, all of them
//! for a node coming up or going down, or a reload. A completion wakes only the requests
//! for the same model, not every waiter.

use std::sync::{Arc, Weak};

use hashbrown::HashMap;
use parking_lot::Mutex;
use tokio::sync::Notify;

#[derive(Default)]
pub struct Wakeups {
    /// One per model that requests wait for now. Weak: a model's entry goes when its last
    /// waiter does, so invented model names leave nothing behind.
    by_model: Mutex<HashMap<String, Weak<Notify>>>,
    /// Fleet-wide news: a node came up or went down, the configuration changed.
    fleet: Notify,
}

/// What a waiting request listens to; see [`Wakeups::listen`] and [`Listener::news`].
pub struct Listener {
    model: Arc<Notify>,
}

impl Wakeups {
    /// A handle to wait on for news that concerns `model`.
    pub fn listen(&self, model: &str) -> Listener {
        let mut by_model = self.by_model.lock();
        if let Some(notify) = by_model.get(model).and_then(Weak::upgrade) {
            return Listener { model: notify };
        }
        by_model.retain(|_, w| w.strong_count() > 0);
        let notify = Arc::new(Notify::new());
        by_model.insert(model.to_string(), Arc::downgrade(&notify));
        Listener { model: notify }
    }

    /// Something changed for this model: a slot freed, a load or an unload seen.
    pub fn model_changed(&self, model: &str) {
        let notify = self.by_model.lock().get(model).and_then(Weak::upgrade);
        if let Some(notify) = notify {
            notify.notify_waiters();
        }
    }

    /// A node was admitted or cut off, or the configuration changed: every waiter looks
    /// again.
    pub fn fleet_changed(&self) {
        self.fleet.notify_waiters();
    }

    /// Models with a waiter now.
    #[cfg(test)]
    fn models(&self) -> usize {
        self.by_model
            .lock()
            .values()
            .filter(|w| w.strong_count() > 0)
            .count()
    }
}

impl Listener {
    /// Completes on news for this listener's model, or fleet-wide news, sent after this
    /// call: call it before looking at the fleet, so that news in between is not lost.
    pub fn news<'a>(&'a self, wakeups: &'a Wakeups) -> impl Future<Output = ()> + 'a {
        let mut model = Box::pin(self.model.notified());
        let mut fleet = Box::pin(wakeups.fleet.notified());
        model.as_mut().enable();
        fleet.as_mut().enable();
        async move {
            tokio::select! {
                _ = model => {}
                _ = fleet => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    #[test]
    fn news_for_one_model_wakes_only_its_waiters_and_fleet_news_wakes_all() {
        let w = Wakeups::default();
        let a = w.listen("a");
        let b = w.listen("b");
        let wait_a = a.news(&w);
        let wait_b = b.news(&w);
        tokio::pin!(wait_a, wait_b);
        // Registered at once: news sent before the first poll is not lost.
        w.model_changed("a");
        assert!(wait_a.as_mut().now_or_never().is_some(), "a woken");
        assert!(wait_b.as_mut().now_or_never().is_none(), "b not");
        w.fleet_changed();
        assert!(
            wait_b.as_mut().now_or_never().is_some(),
            "fleet news wakes b"
        );
    }

    #[test]
    fn a_model_without_waiters_leaves_no_entry() {
        let w = Wakeups::default();
        drop(w.listen("invented"));
        let _kept = w.listen("real");
        assert_eq!(w.models(), 1);
        w.model_changed("invented");
    }
}
