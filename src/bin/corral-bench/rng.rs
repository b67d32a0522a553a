//! A seeded pseudo-random generator of our own.
//!
//! The replay must send the same bytes on every machine and with every version of every
//! crate, so that two runs (or two policies in one run) see the same workload. SplitMix64 is
//! ten lines, fast, and good enough to pick words, sizes and think times.

use std::hash::Hasher as _;

/// SplitMix64 (Steele, Lea and Flood, 2014).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// An independent stream for one part of a workload (a conversation, a policy), so that
    /// changing one part does not shift the random numbers of the others.
    pub fn derive(seed: u64, salt: &str, index: u64) -> Rng {
        let mut h = twox_hash::XxHash3_64::with_seed(seed);
        h.write(salt.as_bytes());
        h.write(&index.to_le_bytes());
        Rng(h.finish())
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n`; 0 when `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    /// A number in `0.0..1.0`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// `mean` varied uniformly by up to `spread` (a fraction) either way, at least 1.
    pub fn around(&mut self, mean: u32, spread: f64) -> u32 {
        let factor = 1.0 + spread * (2.0 * self.unit() - 1.0);
        ((f64::from(mean) * factor).round() as u32).max(1)
    }

    /// An index into `weights`, chosen with probability proportional to its weight.
    pub fn weighted(&mut self, weights: &[u32]) -> usize {
        let total: u64 = weights.iter().map(|&w| u64::from(w)).sum();
        let mut pick = self.below(total);
        for (i, &w) in weights.iter().enumerate() {
            if pick < u64::from(w) {
                return i;
            }
            pick -= u64::from(w);
        }
        0
    }

    /// Lowercase words separated by spaces, exactly `bytes` long. Random letters keep
    /// different conversations from sharing a prefix by accident.
    pub fn text(&mut self, bytes: usize) -> String {
        let mut out = String::with_capacity(bytes + 8);
        while out.len() < bytes {
            let len = 2 + self.below(6) as usize;
            for _ in 0..len {
                out.push(char::from(b'a' + self.below(26) as u8));
            }
            out.push(' ');
        }
        out.truncate(bytes);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_numbers() {
        let a: Vec<u64> = (0..4).map(|_| Rng::new(7).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        let mut r = Rng::derive(1, "x", 2);
        let mut s = Rng::derive(1, "x", 2);
        assert_eq!(r.text(100), s.text(100));
        assert_ne!(Rng::derive(1, "x", 3).next_u64(), r.next_u64());
    }

    #[test]
    fn text_has_the_exact_length() {
        let mut r = Rng::new(3);
        for n in [0, 1, 7, 4000] {
            assert_eq!(r.text(n).len(), n);
        }
    }

    #[test]
    fn weighted_respects_zero_weights() {
        let mut r = Rng::new(5);
        for _ in 0..100 {
            assert_eq!(r.weighted(&[0, 3, 0]), 1);
        }
    }
}
