//! Serial number arithmetic (RFC 1982, with SERIAL_BITS = 32) for CmdSN, StatSN, DataSN and
//! R2TSN, as RFC 7143 §4.2.2.1 requires. Comparisons are only defined for values less than
//! 2^31 apart; `lt`/`gt` return false for the undefined case, which makes "outside the window"
//! the safe answer.

macro_rules! serial_newtype {
    ($(#[$m:meta])* $name:ident) => {
        $(#[$m])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
        pub struct $name(pub u32);

        impl $name {
            /// RFC 1982 "less than".
            pub fn lt(self, other: Self) -> bool {
                let (a, b) = (self.0, other.0);
                a != b && (((a < b) && (b - a) < (1 << 31)) || ((a > b) && (a - b) > (1 << 31)))
            }
            /// RFC 1982 "greater than".
            pub fn gt(self, other: Self) -> bool {
                other.lt(self)
            }
            /// `self <= other` in serial arithmetic.
            pub fn le(self, other: Self) -> bool {
                self == other || self.lt(other)
            }
            /// `self >= other` in serial arithmetic.
            pub fn ge(self, other: Self) -> bool {
                self == other || self.gt(other)
            }
            /// Serial addition (wraps at 2^32).
            pub fn plus(self, n: u32) -> Self {
                $name(self.0.wrapping_add(n))
            }
            /// The next number in sequence.
            pub fn next(self) -> Self {
                self.plus(1)
            }
            /// Distance from `earlier` to `self` (wrapping), meaningful when `earlier <= self`.
            pub fn since(self, earlier: Self) -> u32 {
                self.0.wrapping_sub(earlier.0)
            }
        }

        impl std::fmt::Debug for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}({})", stringify!($name), self.0)
            }
        }
        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}", self.0)
            }
        }
    };
}

serial_newtype!(
    /// Command sequence number (RFC 7143 §4.2.2.1).
    CmdSn
);
serial_newtype!(
    /// Status sequence number (RFC 7143 §4.2.2.2).
    StatSn
);
serial_newtype!(
    /// Data / R2T sequence number (RFC 7143 §4.2.2.3).
    DataSn
);

#[cfg(test)]
mod tests {
    use super::CmdSn;

    #[test]
    fn compares_across_wraparound() {
        assert!(CmdSn(u32::MAX).lt(CmdSn(0)));
        assert!(CmdSn(0).gt(CmdSn(u32::MAX)));
        assert!(CmdSn(5).lt(CmdSn(6)));
        assert!(!CmdSn(6).lt(CmdSn(6)));
        assert!(CmdSn(u32::MAX - 10).plus(20).gt(CmdSn(u32::MAX)));
        assert_eq!(CmdSn(u32::MAX).next(), CmdSn(0));
        assert_eq!(CmdSn(3).since(CmdSn(u32::MAX)), 4);
    }

    #[test]
    fn undefined_comparison_is_neither_less_nor_greater() {
        let a = CmdSn(0);
        let b = CmdSn(1 << 31);
        assert!(!a.lt(b) && !a.gt(b));
    }
}
