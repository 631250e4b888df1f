//! A persistent sequence in chunks: what the sources keep each kind's objects in.
//!
//! A clone shares every chunk; a change copies the list of chunks (a few hundred handles at
//! 150,000 objects) and the one chunk it falls in. `imbl::Vector` shares the same way, but
//! its insertion and removal in the middle join two trees and repack every leaf after the
//! join within the nodes it meets: at 150,000 pods, adding or removing one pod cost 0.1 to
//! 0.3 ms, and freeing the old version's repacked leaves as much again. Here an insertion or
//! removal costs a few microseconds: chunks split when they grow past [`MAX_CHUNK`] and go
//! when they empty. Positions are found from the chunks' first positions by binary search.

use std::sync::Arc;

/// Elements a chunk holds when a sequence is built at once.
const CHUNK: usize = 256;
/// A chunk that grows past this splits in two.
const MAX_CHUNK: usize = 2 * CHUNK;
/// The smallest chunk [`Seq::append`] shares rather than copies.
const MIN_SHARED: usize = CHUNK / 8;

/// One chunk and the position of its first element.
struct Chunk<T> {
    start: usize,
    items: Arc<Vec<T>>,
}

impl<T> Clone for Chunk<T> {
    fn clone(&self) -> Self {
        Self {
            start: self.start,
            items: Arc::clone(&self.items),
        }
    }
}

/// A persistent sequence (see the module's documentation). Its chunks are never empty.
pub struct Seq<T> {
    chunks: Arc<Vec<Chunk<T>>>,
    len: usize,
}

impl<T> Clone for Seq<T> {
    fn clone(&self) -> Self {
        Self {
            chunks: Arc::clone(&self.chunks),
            len: self.len,
        }
    }
}

impl<T> Default for Seq<T> {
    fn default() -> Self {
        Self {
            chunks: Arc::new(Vec::new()),
            len: 0,
        }
    }
}

impl<T: Clone> Seq<T> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether both are the same shared sequence (so certainly equal).
    pub fn ptr_eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.chunks, &other.chunks)
    }

    pub fn get(&self, index: usize) -> Option<&T> {
        let chunk = &self.chunks[self.chunk_of(index)?];
        chunk.items.get(index - chunk.start)
    }

    /// The chunk holding position `index` (`None`: past the end).
    fn chunk_of(&self, index: usize) -> Option<usize> {
        if index >= self.len {
            return None;
        }
        Some(self.chunks.partition_point(|c| c.start <= index) - 1)
    }

    /// The position of the first element of the chunk holding `index`, and that chunk's
    /// elements (`index` within the sequence).
    pub fn chunk_at(&self, index: usize) -> Option<(usize, &[T])> {
        let chunk = &self.chunks[self.chunk_of(index)?];
        Some((chunk.start, chunk.items.as_slice()))
    }

    pub fn iter(&self) -> Iter<'_, T> {
        Iter {
            inner: self.chunks.iter().flat_map(chunk_items),
            remaining: self.len,
        }
    }

    pub fn push_back(&mut self, value: T) {
        let len = self.len;
        let chunks = Arc::make_mut(&mut self.chunks);
        match chunks.last_mut() {
            Some(last) if last.items.len() < CHUNK => Arc::make_mut(&mut last.items).push(value),
            _ => chunks.push(Chunk {
                start: len,
                items: Arc::new(vec![value]),
            }),
        }
        self.len += 1;
    }

    /// Puts `other`'s elements after this one's, sharing its chunks of [`MIN_SHARED`] or more
    /// elements (a manifest directory's state is its files' lists one after the other:
    /// 20,000 objects were pushed one by one at each read); smaller ones are copied, so that
    /// a list put together from many small ones (a file's, from one a document) is not
    /// thousands of one-element chunks, which every walk then steps through one by one.
    pub fn append(&mut self, other: &Self) {
        if self.is_empty() && other.chunks.iter().all(|c| c.items.len() >= MIN_SHARED) {
            *self = other.clone();
            return;
        }
        for chunk in other.chunks.iter() {
            if chunk.items.len() < MIN_SHARED {
                self.extend(chunk.items.iter().cloned());
                continue;
            }
            let start = self.len;
            Arc::make_mut(&mut self.chunks).push(Chunk {
                start,
                items: Arc::clone(&chunk.items),
            });
            self.len += chunk.items.len();
        }
    }

    /// Puts `value` at `index` (at most the length), the elements from there one further.
    pub fn insert(&mut self, index: usize, value: T) {
        assert!(index <= self.len, "insertion at {index} past {}", self.len);
        if index == self.len {
            return self.push_back(value);
        }
        let at = self.chunk_of(index).expect("within the sequence");
        let chunks = Arc::make_mut(&mut self.chunks);
        let chunk = &mut chunks[at];
        let items = Arc::make_mut(&mut chunk.items);
        items.insert(index - chunk.start, value);
        if items.len() > MAX_CHUNK {
            let upper = items.split_off(items.len() / 2);
            let start = chunk.start + items.len();
            chunks.insert(
                at + 1,
                Chunk {
                    start,
                    items: Arc::new(upper),
                },
            );
            shift_starts(&mut chunks[at + 2..], 1);
        } else {
            shift_starts(&mut chunks[at + 1..], 1);
        }
        self.len += 1;
    }

    /// Takes the element at `index` out, the elements after it one nearer.
    pub fn remove(&mut self, index: usize) -> T {
        let at = self
            .chunk_of(index)
            .unwrap_or_else(|| panic!("removal at {index} past {}", self.len));
        let chunks = Arc::make_mut(&mut self.chunks);
        let chunk = &mut chunks[at];
        let items = Arc::make_mut(&mut chunk.items);
        let value = items.remove(index - chunk.start);
        if items.is_empty() {
            chunks.remove(at);
            shift_starts(&mut chunks[at..], -1);
        } else {
            shift_starts(&mut chunks[at + 1..], -1);
        }
        self.len -= 1;
        value
    }

    /// The element at `index`, to change in place (its chunk copied when shared).
    pub fn get_mut(&mut self, index: usize) -> Option<&mut T> {
        let at = self.chunk_of(index)?;
        let chunk = &mut Arc::make_mut(&mut self.chunks)[at];
        Arc::make_mut(&mut chunk.items).get_mut(index - chunk.start)
    }

    /// Keeps the first `len` elements (all of them when there are fewer). The chunks before
    /// the cut stay shared.
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        let at = self.chunk_of(len).expect("within the sequence");
        let chunks = Arc::make_mut(&mut self.chunks);
        let kept = len - chunks[at].start;
        if kept == 0 {
            chunks.truncate(at);
        } else {
            chunks.truncate(at + 1);
            Arc::make_mut(&mut chunks[at].items).truncate(kept);
        }
        self.len = len;
    }

    /// Keeps the elements `keep` says, in order. Chunks it keeps whole stay shared.
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        let mut kept = Vec::with_capacity(self.chunks.len());
        let mut len = 0;
        for chunk in self.chunks.iter() {
            let flags: Vec<bool> = chunk.items.iter().map(&mut keep).collect();
            let items = if flags.iter().all(|k| *k) {
                Arc::clone(&chunk.items)
            } else {
                let items: Vec<T> = chunk
                    .items
                    .iter()
                    .zip(&flags)
                    .filter(|(_, k)| **k)
                    .map(|(item, _)| item.clone())
                    .collect();
                if items.is_empty() {
                    continue;
                }
                Arc::new(items)
            };
            let size = items.len();
            kept.push(Chunk { start: len, items });
            len += size;
        }
        *self = Self {
            chunks: Arc::new(kept),
            len,
        };
    }

    /// As `slice::binary_search_by`, over the whole sequence: the chunk first (by its last
    /// element), then the place in it.
    pub fn binary_search_by(
        &self,
        mut compare: impl FnMut(&T) -> std::cmp::Ordering,
    ) -> Result<usize, usize> {
        let at = self.chunks.partition_point(|c| {
            let last = c.items.last().expect("chunks are never empty");
            compare(last) == std::cmp::Ordering::Less
        });
        let Some(chunk) = self.chunks.get(at) else {
            return Err(self.len);
        };
        chunk
            .items
            .binary_search_by(compare)
            .map(|i| chunk.start + i)
            .map_err(|i| chunk.start + i)
    }

    /// A cursor for reading positions (cheap when each is in the chunk of the last).
    pub fn cursor(&self) -> Cursor<'_, T> {
        Cursor {
            seq: self,
            chunk: 0,
        }
    }
}

impl<T: Clone> std::ops::Index<usize> for Seq<T> {
    type Output = T;

    fn index(&self, index: usize) -> &T {
        self.get(index)
            .unwrap_or_else(|| panic!("position {index} past {}", self.len))
    }
}

impl<T: Clone> std::ops::IndexMut<usize> for Seq<T> {
    /// See [`Seq::get_mut`].
    fn index_mut(&mut self, index: usize) -> &mut T {
        let len = self.len;
        self.get_mut(index)
            .unwrap_or_else(|| panic!("position {index} past {len}"))
    }
}

impl<T: Clone + std::fmt::Debug> std::fmt::Debug for Seq<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: Clone + PartialEq> PartialEq for Seq<T> {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && (self.ptr_eq(other) || self.iter().eq(other.iter()))
    }
}

fn chunk_items<T>(chunk: &Chunk<T>) -> std::slice::Iter<'_, T> {
    chunk.items.iter()
}

/// Moves the first positions of `chunks` by `by`.
fn shift_starts<T>(chunks: &mut [Chunk<T>], by: isize) {
    for chunk in chunks {
        chunk.start = chunk.start.wrapping_add_signed(by);
    }
}

impl<T: Clone> FromIterator<T> for Seq<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        let mut chunks = Vec::new();
        let mut len = 0;
        let mut iter = iter.into_iter().peekable();
        while iter.peek().is_some() {
            let items: Vec<T> = iter.by_ref().take(CHUNK).collect();
            let size = items.len();
            chunks.push(Chunk {
                start: len,
                items: Arc::new(items),
            });
            len += size;
        }
        Self {
            chunks: Arc::new(chunks),
            len,
        }
    }
}

impl<T: Clone> From<Vec<T>> for Seq<T> {
    fn from(items: Vec<T>) -> Self {
        items.into_iter().collect()
    }
}

impl<T: Clone> Extend<T> for Seq<T> {
    fn extend<I: IntoIterator<Item = T>>(&mut self, iter: I) {
        for value in iter {
            self.push_back(value);
        }
    }
}

/// Each chunk's elements, one chunk after the other.
type Flattened<'a, T> = std::iter::FlatMap<
    std::slice::Iter<'a, Chunk<T>>,
    std::slice::Iter<'a, T>,
    fn(&'a Chunk<T>) -> std::slice::Iter<'a, T>,
>;

/// The elements of a [`Seq`], in order.
pub struct Iter<'a, T> {
    inner: Flattened<'a, T>,
    remaining: usize,
}

impl<'a, T> Iterator for Iter<'a, T> {
    type Item = &'a T;

    fn next(&mut self) -> Option<&'a T> {
        let next = self.inner.next()?;
        self.remaining -= 1;
        Some(next)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining, Some(self.remaining))
    }
}

impl<T> DoubleEndedIterator for Iter<'_, T> {
    fn next_back(&mut self) -> Option<Self::Item> {
        let next = self.inner.next_back()?;
        self.remaining -= 1;
        Some(next)
    }
}

impl<T> ExactSizeIterator for Iter<'_, T> {}

/// Reads a [`Seq`] by position, keeping the last chunk at hand.
pub struct Cursor<'a, T> {
    seq: &'a Seq<T>,
    chunk: usize,
}

impl<'a, T: Clone> Cursor<'a, T> {
    pub fn len(&self) -> usize {
        self.seq.len
    }

    pub fn is_empty(&self) -> bool {
        self.seq.is_empty()
    }

    /// The chunk holding `index`: the last one read when it does.
    fn chunk_holding(&mut self, index: usize) -> Option<&'a Chunk<T>> {
        let chunks: &'a [Chunk<T>] = &self.seq.chunks;
        let holds = |c: &Chunk<T>| (c.start..c.start + c.items.len()).contains(&index);
        if !chunks.get(self.chunk).is_some_and(holds) {
            self.chunk = self.seq.chunk_of(index)?;
        }
        chunks.get(self.chunk)
    }

    pub fn get(&mut self, index: usize) -> Option<&'a T> {
        let chunk = self.chunk_holding(index)?;
        chunk.items.get(index - chunk.start)
    }

    /// See [`Seq::chunk_at`].
    pub fn chunk_at(&mut self, index: usize) -> Option<(usize, &'a [T])> {
        let chunk = self.chunk_holding(index)?;
        Some((chunk.start, chunk.items.as_slice()))
    }
}

/// How many elements from position `i` of `a` and `j` of `b` are the same objects: a chunk
/// both share is passed at once, so two versions of a long list that differ in one chunk
/// are walked in a few steps.
pub fn shared_run<T>(
    a: &mut Cursor<'_, Arc<T>>,
    i: usize,
    b: &mut Cursor<'_, Arc<T>>,
    j: usize,
) -> usize {
    let mut run = 0;
    while let (Some((at_a, chunk_a)), Some((at_b, chunk_b))) =
        (a.chunk_at(i + run), b.chunk_at(j + run))
    {
        let rest_a = &chunk_a[i + run - at_a..];
        let rest_b = &chunk_b[j + run - at_b..];
        let span = rest_a.len().min(rest_b.len());
        if std::ptr::eq(rest_a.as_ptr(), rest_b.as_ptr()) {
            run += span;
            continue;
        }
        let same = rest_a
            .iter()
            .zip(rest_b)
            .take_while(|(x, y)| Arc::ptr_eq(x, y))
            .count();
        run += same;
        if same < span {
            break;
        }
    }
    run
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::TestRng;

    /// Every reading of `seq` gives what `model` holds.
    fn assert_same(seq: &Seq<u32>, model: &[u32], step: usize) {
        assert_eq!(seq.len(), model.len(), "step {step}");
        assert_eq!(
            seq.iter().copied().collect::<Vec<_>>(),
            model,
            "step {step}"
        );
        assert_eq!(
            seq.iter().rev().copied().collect::<Vec<_>>(),
            model.iter().rev().copied().collect::<Vec<_>>(),
            "step {step}"
        );
        assert_eq!(seq.iter().len(), model.len());
        let mut cursor = seq.cursor();
        for (i, value) in model.iter().enumerate() {
            assert_eq!(seq.get(i), Some(value), "step {step} at {i}");
            assert_eq!(cursor.get(i), Some(value), "step {step} at {i}");
            let (start, chunk) = seq.chunk_at(i).expect("a chunk");
            assert!(start <= i && i < start + chunk.len());
            assert_eq!(chunk[i - start], *value);
        }
        assert_eq!(seq.get(model.len()), None);
        // Positions read backwards, as a cursor may be.
        for i in (0..model.len()).rev().step_by(7) {
            assert_eq!(cursor.get(i), Some(&model[i]));
        }
        assert!(seq.chunks.iter().all(|c| !c.items.is_empty()));
        assert!(seq.chunks.iter().all(|c| c.items.len() <= MAX_CHUNK));
    }

    /// Random insertions, removals, changes, appends and retains, as a `Vec` does them, with old
    /// versions kept (so that chunks are shared) and unchanged by what follows.
    #[test]
    fn a_sequence_changes_as_a_vec_does_and_its_old_versions_stay() {
        let mut rng = TestRng::new(11);
        let mut model: Vec<u32> = (0..1_500).map(|i| i * 2).collect();
        let mut seq: Seq<u32> = model.iter().copied().collect();
        let mut kept: Vec<(Seq<u32>, Vec<u32>)> = Vec::new();
        for step in 0..3_000 {
            match rng.below(10) {
                0..=3 => {
                    let at = rng.below(model.len() as u64 + 1) as usize;
                    let value = rng.below(1_000_000) as u32;
                    model.insert(at, value);
                    seq.insert(at, value);
                }
                4..=6 if !model.is_empty() => {
                    let at = rng.below(model.len() as u64) as usize;
                    assert_eq!(seq.remove(at), model.remove(at), "step {step}");
                }
                7 if !model.is_empty() => {
                    let at = rng.below(model.len() as u64) as usize;
                    *seq.get_mut(at).expect("within") += 1;
                    model[at] += 1;
                }
                8 if rng.below(3) == 0 && !kept.is_empty() => {
                    // The first few of an old version, appended: its chunks shared.
                    let (old, old_model) = &kept[rng.below(kept.len() as u64) as usize];
                    let take = (rng.below(80) as usize).min(old_model.len());
                    let mut other = old.clone();
                    other.truncate(take);
                    seq.append(&other);
                    model.extend_from_slice(&old_model[..take]);
                }
                8 => {
                    let value = rng.below(1_000_000) as u32;
                    model.push(value);
                    seq.push_back(value);
                }
                9 if rng.below(4) == 0 => {
                    // The last few: within the last chunk or across a chunk boundary.
                    let cut = model.len().saturating_sub(rng.below(60) as usize);
                    model.truncate(cut);
                    seq.truncate(cut);
                }
                _ => {
                    let modulus = 2 + rng.below(40) as u32;
                    model.retain(|v| v % modulus != 0);
                    seq.retain(|v| v % modulus != 0);
                }
            }
            if step % 50 == 0 {
                assert_same(&seq, &model, step);
                kept.push((seq.clone(), model.clone()));
            }
        }
        for (step, (old, model)) in kept.iter().enumerate() {
            assert_same(old, model, step);
        }
    }

    #[test]
    fn a_sorted_sequence_is_searched_as_a_slice_is() {
        let model: Vec<u32> = (0..2_000).map(|i| i * 3).collect();
        let mut seq: Seq<u32> = model.iter().copied().collect();
        // Chunks of uneven sizes.
        for i in (0..600).step_by(5) {
            seq.insert(i, seq.get(i).copied().expect("within"));
            seq.remove(i);
        }
        for target in 0..6_010 {
            let found = seq.binary_search_by(|v| v.cmp(&target));
            assert_eq!(found, model.binary_search(&target), "{target}");
        }
        assert_eq!(Seq::<u32>::new().binary_search_by(|v| v.cmp(&1)), Err(0));
    }

    /// Appended, a chunk of [`MIN_SHARED`] or more is shared and a smaller one copied: many
    /// one-element sequences make a few full chunks, not one chunk each.
    #[test]
    fn appending_shares_large_chunks_and_copies_small_ones() {
        let mut seq: Seq<u32> = Seq::new();
        for value in 0..300 {
            seq.append(&Seq::from(vec![value]));
        }
        assert_eq!(seq.chunks.len(), 2);
        let big: Seq<u32> = (1000..1300).collect();
        seq.append(&big);
        assert_eq!(seq.len(), 600);
        // 256 shared, 44 copied after it.
        let shared = &seq.chunks[2];
        assert!(Arc::ptr_eq(&shared.items, &big.chunks[0].items));
        assert_eq!(shared.start, 300);
        let model: Vec<u32> = (0..300).chain(1000..1300).collect();
        assert_same(&seq, &model, 0);
        // Changing the appended copy leaves the original as it was.
        *seq.get_mut(310).expect("within") = 7;
        assert_eq!(big.get(10), Some(&1010));
    }

    /// A change copies the chunk it falls in; the others stay shared with the old version.
    #[test]
    fn a_change_copies_one_chunk() {
        let seq: Seq<u32> = (0..10_000).collect();
        let mut changed = seq.clone();
        changed.insert(5_000, 7);
        changed.remove(9_000);
        let shared = seq
            .chunks
            .iter()
            .filter(|c| {
                changed
                    .chunks
                    .iter()
                    .any(|d| Arc::ptr_eq(&c.items, &d.items))
            })
            .count();
        assert_eq!(shared, seq.chunks.len() - 2);
        assert!(!seq.ptr_eq(&changed));
        assert!(seq.ptr_eq(&seq.clone()));
    }
}
