//! The large pure work of a sync (a first sync's 10,000 Services and Maglev tables, 150,000
//! pods, 100 EgressFirewalls) on every core, and a change's small work on the calling thread:
//! handing a few items to the pool and waiting for them costs about as much as their work.

use rayon::prelude::*;

/// `f` of each of `items`, in order: on every core (`rayon`) when there are `per_task` or
/// more, each task taking at least `per_task` of them; on this thread when fewer.
pub fn map<T: Sync, R: Send>(items: &[T], per_task: usize, f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    if items.len() < per_task {
        return items.iter().map(f).collect();
    }
    items.par_iter().with_min_len(per_task).map(&f).collect()
}

/// [`map`] for owned items, on every core when `parallel` (the caller weighs them: items of
/// very different sizes).
pub fn map_owned<T: Send, R: Send>(
    items: Vec<T>,
    parallel: bool,
    f: impl Fn(T) -> R + Sync + Send,
) -> Vec<R> {
    if !parallel {
        return items.into_iter().map(f).collect();
    }
    items.into_par_iter().map(f).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whichever side of the threshold, every item's result comes back in the items' order.
    #[test]
    fn results_come_back_in_order_on_either_side_of_the_threshold() {
        let items: Vec<u32> = (0..1000).collect();
        let doubled: Vec<u32> = items.iter().map(|i| i * 2).collect();
        assert_eq!(map(&items, 64, |i| i * 2), doubled);
        assert_eq!(map(&items, 4096, |i| i * 2), doubled);
        assert_eq!(map_owned(items.clone(), true, |i| i * 2), doubled);
        assert_eq!(map_owned(items, false, |i| i * 2), doubled);
        assert!(map(&[] as &[u32], 1, |i| *i).is_empty());
    }
}
