//! A seeded random sequence for the randomized tests: the same steps at every run, so a
//! failing step can be replayed.

pub struct TestRng(u64);

impl TestRng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next number below `bound` (a linear congruential step, its high bits).
    pub fn below(&mut self, bound: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % bound
    }
}
