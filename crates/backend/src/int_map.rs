//! A hash map for small integer keys on the per-command path (ITTs, LUNs, nexus ids, RAM
//! chunk numbers).
//!
//! The standard map hashes with SipHash-1-3, built to resist crafted keys: 500-650
//! instructions per 4K command went into it (callgrind), for maps that the command path
//! touches five times. Here a key is mixed by a few multiplications. Keys an initiator chooses
//! (ITTs) can be crafted to collide, but every such map is bounded per session (the CmdSN
//! window bounds running commands and pending writes), so a worst case costs a probe over at
//! most that many entries, never unbounded work.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Multiplicative mixer for integer keys (see the module docs).
#[derive(Default, Clone, Copy, Debug)]
pub struct IntHasher(u64);

/// 2^64 / golden ratio, odd: multiplication by it spreads every input bit upwards.
const MIX: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for IntHasher {
    fn finish(&self) -> u64 {
        // MurmurHash3's 64-bit finaliser: every input bit reaches the low bits the table
        // indexes with and the high bits of its control bytes.
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
        h ^= h >> 33;
        h = h.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
        h ^ (h >> 33)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }
    fn write_u16(&mut self, n: u16) {
        self.write_u64(u64::from(n));
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(MIX);
    }
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// A `HashMap` keyed by small integers, hashed with [`IntHasher`].
pub type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<IntHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_differing_only_in_high_or_low_bits_spread_over_the_table() {
        for keys in [
            (0..4096u64).collect::<Vec<_>>(),
            (0..4096u64).map(|i| i << 20).collect(),
            (0..4096u64).map(|i| i << 48).collect(),
        ] {
            let mut buckets = std::collections::HashSet::new();
            for k in &keys {
                let mut h = IntHasher::default();
                h.write_u64(*k);
                buckets.insert(h.finish() & 4095);
            }
            // A random function fills about 63 % of 4096 buckets with 4096 keys.
            assert!(
                buckets.len() > 2000,
                "{} of 4096 buckets used",
                buckets.len()
            );
        }
        let mut m: IntMap<u32, u32> = IntMap::default();
        for i in 0..1000 {
            m.insert(i << 16, i);
        }
        assert!((0..1000).all(|i| m.get(&(i << 16)) == Some(&i)));
    }
}
