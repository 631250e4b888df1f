//! One kind's objects in a persistent sequence, with a journal of the keys placed in it, so
//! that two reads share what did not change and the difference is found by the keys noted.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use crate::seq::{self, Seq};

/// One kind's objects, in a persistent sequence ([`Seq`]): states share it, and a change
/// copies only the chunk it falls in and the list of chunks. At 150,000 pods, copying the
/// whole list for one changed pod cost more than the change itself. An empty list allocates
/// nothing (a parse holds one object of one kind).
pub struct Objects<T>(Option<Box<Listed<T>>>);

/// A list and the journal of what was placed in it.
struct Listed<T> {
    objects: Seq<Arc<T>>,
    journal: Journal,
}

/// The keys placed in a list ([`Objects::place`]) since its journal began, so that a later
/// version of the list tells what differs from an earlier one without walking both (one pod
/// added among 150,000 walked 2,344 chunks). Any other change to the list begins a new
/// journal, which the next comparison with a version from before it cannot use: that one
/// walks the lists.
#[derive(Clone)]
struct Journal {
    /// Unique to this journal's beginning.
    base: u64,
    /// Each placed key (namespace, empty for none, and name) with a number unique to that
    /// placing: two versions agree up to an entry when both hold its number there.
    entries: imbl::Vector<(u64, (String, String))>,
}

/// How many placings a journal holds before it begins anew (a comparison across that walks).
const JOURNAL_LIMIT: usize = 4096;

/// Numbers unique within the process, for journals' beginnings and entries.
fn journal_number() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Journal {
    fn new() -> Self {
        Self {
            base: journal_number(),
            entries: imbl::Vector::new(),
        }
    }

    fn note(&mut self, key: (&str, &str)) {
        if self.entries.len() >= JOURNAL_LIMIT {
            *self = Self::new();
        }
        let key = (key.0.to_owned(), key.1.to_owned());
        self.entries.push_back((journal_number(), key));
    }

    /// The keys noted here since `old`'s last entry, when this journal is `old`'s continued
    /// (`None`: it is not, or not known to be).
    fn since<'a>(&'a self, old: &Self) -> Option<impl Iterator<Item = (&'a str, &'a str)>> {
        let at = old.entries.len();
        let continued = self.base == old.base
            && self.entries.len() >= at
            && (at == 0
                || self.entries.get(at - 1).map(|e| e.0) == old.entries.back().map(|e| e.0));
        continued.then(|| {
            (at..self.entries.len())
                .filter_map(|i| self.entries.get(i))
                .map(|(_, (namespace, name))| (namespace.as_str(), name.as_str()))
        })
    }
}

impl<T> Listed<T> {
    fn new(objects: Seq<Arc<T>>) -> Self {
        Self {
            objects,
            journal: Journal::new(),
        }
    }
}

impl<T> Clone for Listed<T> {
    fn clone(&self) -> Self {
        Self {
            objects: self.objects.clone(),
            journal: self.journal.clone(),
        }
    }
}

impl<T> Objects<T> {
    /// Whether the list holds an allocation (an empty one holds none).
    #[cfg(test)]
    pub(super) fn allocated(&self) -> bool {
        self.0.is_some()
    }

    fn listed_mut(&mut self) -> &mut Listed<T> {
        self.0
            .get_or_insert_with(|| Box::new(Listed::new(Seq::new())))
    }

    /// The list, to be changed other than by placing (which begins a new journal).
    fn vector_mut(&mut self) -> &mut Seq<Arc<T>> {
        let listed = self.listed_mut();
        listed.journal = Journal::new();
        &mut listed.objects
    }

    fn vector(&self) -> Option<&Seq<Arc<T>>> {
        self.0.as_ref().map(|listed| &listed.objects)
    }

    pub fn len(&self) -> usize {
        self.vector().map_or(0, |v| v.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn iter(&self) -> ObjectsIter<'_, T> {
        ObjectsIter(self.vector().map(|v| v.iter()))
    }

    pub fn get(&self, index: usize) -> Option<&Arc<T>> {
        self.vector()?.get(index)
    }

    pub fn first(&self) -> Option<&Arc<T>> {
        self.get(0)
    }

    pub fn to_vec(&self) -> Vec<Arc<T>> {
        self.iter().cloned().collect()
    }

    pub fn push(&mut self, object: Arc<T>) {
        self.vector_mut().push_back(object);
    }

    pub fn insert(&mut self, index: usize, object: Arc<T>) {
        self.vector_mut().insert(index, object);
    }

    pub fn remove(&mut self, index: usize) -> Arc<T> {
        self.vector_mut().remove(index)
    }

    pub fn retain(&mut self, mut keep: impl FnMut(&Arc<T>) -> bool) {
        if self.0.is_some() {
            self.vector_mut().retain(|object| keep(object));
        }
    }

    pub fn binary_search_by(
        &self,
        compare: impl FnMut(&Arc<T>) -> std::cmp::Ordering,
    ) -> Result<usize, usize> {
        self.vector()
            .map_or(Err(0), |v| v.binary_search_by(compare))
    }

    /// A cursor for reading positions in order (cheap when each is near the last).
    pub fn cursor(&self) -> ObjectsCursor<'_, T> {
        ObjectsCursor(self.vector().map(|v| v.cursor()))
    }

    /// Whether both are the same shared list (so certainly equal).
    pub fn shares(&self, other: &Self) -> bool {
        match (self.vector(), other.vector()) {
            (Some(a), Some(b)) => a.ptr_eq(b),
            (a, b) => a.is_none() && b.is_none(),
        }
    }

    /// Whether both hold the same objects (shared, not copies) in the same order: the same
    /// shared list, or one made again of the same objects.
    pub fn holds_the_same(&self, other: &Self) -> bool {
        self.shares(other)
            || (self.len() == other.len()
                && self
                    .iter()
                    .zip(other.iter())
                    .all(|(a, b)| Arc::ptr_eq(a, b)))
    }
}

impl<T: kube::Resource> Objects<T> {
    /// The first object named `name` in `namespace` (`None`: none, a cluster-scoped one).
    /// The sources keep each list in that order, so a binary search finds it; in a list in
    /// another order (one assembled by hand) a scan does.
    pub fn find(&self, namespace: Option<&str>, name: &str) -> Option<&Arc<T>> {
        let at = (namespace.unwrap_or(""), name);
        match self.position_in_order(namespace, name) {
            Some(found) => self.get(found),
            None => self.iter().find(|object| order_key(&***object) == at),
        }
    }

    /// Where the first object named `name` in `namespace` is, found by binary search in
    /// the sources' order (namespace, then name); `None` also when the list is in another
    /// order and the search misses it.
    pub fn position_in_order(&self, namespace: Option<&str>, name: &str) -> Option<usize> {
        let at = (namespace.unwrap_or(""), name);
        let mut found = self
            .binary_search_by(|object| order_key(&**object).cmp(&at))
            .ok()?;
        while found > 0 && self.get(found - 1).is_some_and(|o| order_key(&**o) == at) {
            found -= 1;
        }
        Some(found)
    }
}

impl<T: kube::Resource> Objects<T> {
    /// Puts `new` in place of the object keyed `at` (namespace, empty for none, and name) in
    /// a list in key order (`None`: removes it), and notes the key in the list's journal.
    pub fn place(&mut self, at: (&str, &str), new: Option<&Arc<T>>) {
        let found = self.binary_search_by(|object| order_key(&**object).cmp(&at));
        let listed = self.listed_mut();
        match (found, new) {
            (Ok(index), Some(object)) => {
                if let Some(slot) = listed.objects.get_mut(index) {
                    *slot = Arc::clone(object);
                }
            }
            (Ok(index), None) => {
                listed.objects.remove(index);
            }
            (Err(index), Some(object)) => listed.objects.insert(index, Arc::clone(object)),
            (Err(_), None) => return,
        }
        listed.journal.note(at);
    }

    /// The keys placed in this list since `old`, an earlier version of it, was taken, when
    /// only placings changed it since (`None`: not known; the lists must be compared). Each
    /// key is the object's namespace (empty for none) and name, and may come more than once.
    pub fn placed_since<'a>(
        &'a self,
        old: &Self,
    ) -> Option<impl Iterator<Item = (&'a str, &'a str)>> {
        let (listed, old) = (self.0.as_ref()?, old.0.as_ref()?);
        listed.journal.since(&old.journal)
    }

    /// The object keyed `at` (namespace, empty for none, and name) of a list in key order,
    /// found by binary search.
    pub fn at_key(&self, (namespace, name): (&str, &str)) -> Option<&Arc<T>> {
        self.get(self.position_in_order(Some(namespace), name)?)
    }

    /// Whether the list is in the API source's order (namespace, then name), as
    /// `ObjectCache` keeps every list; a manifest directory's lists are in its files' order
    /// (there the first object of a file order wins where two claim one thing).
    pub fn is_in_key_order(&self) -> bool {
        let mut pairs = self.iter().zip(self.iter().skip(1));
        pairs.all(|(a, b)| order_key(&**a) <= order_key(&**b))
    }

    /// The objects of `namespace` (`""`: those without one): by binary search when
    /// `in_key_order` (what [`Self::is_in_key_order`] said of this list), else by a look at
    /// every object.
    pub fn of_namespace(&self, namespace: &str, in_key_order: bool) -> Vec<Arc<T>> {
        if in_key_order {
            return self.in_namespace(namespace);
        }
        self.iter()
            .filter(|object| order_key(&***object).0 == namespace)
            .cloned()
            .collect()
    }

    /// The objects of `namespace` (`""`: those without one), in name order, found by binary
    /// search: the list must be in key order ([`Self::is_in_key_order`]).
    pub fn in_namespace(&self, namespace: &str) -> Vec<Arc<T>> {
        let boundary = |inclusive: bool| {
            self.binary_search_by(|object| {
                let at = order_key(&**object).0;
                if at < namespace || (inclusive && at == namespace) {
                    std::cmp::Ordering::Less
                } else {
                    std::cmp::Ordering::Greater
                }
            })
            .unwrap_or_else(|index| index)
        };
        let mut cursor = self.cursor();
        (boundary(false)..boundary(true))
            .filter_map(|index| cursor.get(index).cloned())
            .collect()
    }
}

/// The key the sources keep each list in order of: namespace (empty for none), then name.
fn order_key<T: kube::Resource>(object: &T) -> (&str, &str) {
    let meta = object.meta();
    (
        meta.namespace.as_deref().unwrap_or(""),
        meta.name.as_deref().unwrap_or(""),
    )
}

/// Reads an [`Objects`] by position, keeping the last chunk at hand.
pub struct ObjectsCursor<'a, T>(Option<seq::Cursor<'a, Arc<T>>>);

impl<'a, T> ObjectsCursor<'a, T> {
    pub fn get(&mut self, index: usize) -> Option<&'a Arc<T>> {
        self.0.as_mut()?.get(index)
    }

    /// How many objects from position `i` here and `j` in `other` are the same objects. Read
    /// a chunk at a time: where both positions fall at one place of one shared chunk (two
    /// versions of a list share every chunk a change did not copy), the rest of the chunk
    /// is skipped at once, so that walking two versions of 150,000 pods costs a few thousand
    /// steps rather than 150,000.
    pub fn shared_run(&mut self, i: usize, other: &mut Self, j: usize) -> usize {
        let (Some(a), Some(b)) = (self.0.as_mut(), other.0.as_mut()) else {
            return 0;
        };
        seq::shared_run(a, i, b, j)
    }
}

/// The objects of an [`Objects`], in order.
pub struct ObjectsIter<'a, T>(Option<seq::Iter<'a, Arc<T>>>);

impl<'a, T> Iterator for ObjectsIter<'a, T> {
    type Item = &'a Arc<T>;

    fn next(&mut self) -> Option<Self::Item> {
        self.0.as_mut()?.next()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.0.as_ref().map_or((0, Some(0)), |i| i.size_hint())
    }
}

impl<T> DoubleEndedIterator for ObjectsIter<'_, T> {
    fn next_back(&mut self) -> Option<Self::Item> {
        self.0.as_mut()?.next_back()
    }
}

impl<T> ExactSizeIterator for ObjectsIter<'_, T> {}

impl<T> std::ops::Index<usize> for Objects<T> {
    type Output = Arc<T>;

    fn index(&self, index: usize) -> &Arc<T> {
        self.get(index).expect("index within the objects")
    }
}

impl<T> std::ops::IndexMut<usize> for Objects<T> {
    fn index_mut(&mut self, index: usize) -> &mut Arc<T> {
        self.vector_mut()
            .get_mut(index)
            .expect("index within the objects")
    }
}

impl<T> Clone for Objects<T> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<T> Default for Objects<T> {
    fn default() -> Self {
        Self(None)
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Objects<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: PartialEq> PartialEq for Objects<T> {
    fn eq(&self, other: &Self) -> bool {
        self.shares(other) || (self.len() == other.len() && self.iter().eq(other.iter()))
    }
}

impl<T> From<Vec<Arc<T>>> for Objects<T> {
    fn from(list: Vec<Arc<T>>) -> Self {
        list.into_iter().collect()
    }
}

impl<T> FromIterator<Arc<T>> for Objects<T> {
    fn from_iter<I: IntoIterator<Item = Arc<T>>>(iter: I) -> Self {
        let vector: Seq<Arc<T>> = iter.into_iter().collect();
        Self((!vector.is_empty()).then(|| Box::new(Listed::new(vector))))
    }
}

impl<T> Objects<T> {
    /// Puts `other`'s objects after these, sharing its chunks ([`Seq::append`]).
    pub fn append(&mut self, other: &Self) {
        if let Some(objects) = other.vector().filter(|objects| !objects.is_empty()) {
            self.vector_mut().append(objects);
        }
    }
}

impl<T> Extend<Arc<T>> for Objects<T> {
    fn extend<I: IntoIterator<Item = Arc<T>>>(&mut self, iter: I) {
        let mut iter = iter.into_iter().peekable();
        if iter.peek().is_some() {
            self.vector_mut().extend(iter);
        }
    }
}

impl<'a, T> IntoIterator for &'a Objects<T> {
    type Item = &'a Arc<T>;
    type IntoIter = ObjectsIter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}
