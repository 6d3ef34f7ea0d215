//! CRC32C header and data digests (RFC 7143 §13.1, RFC 3720 Appendix B.4).
//!
//! Uses the `crc32c` crate, which selects the SSE 4.2 / ARMv8 CRC instructions at run time.
//! The data digest covers the data segment and its padding.

/// CRC32C of `data`, as sent on the wire (little-endian byte order, RFC 7143 §13.1).
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

/// Continue a CRC32C over more bytes (for scatter/gather payloads).
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    crc32c::crc32c_append(crc, data)
}

/// Digest over a data segment and its zero padding to a 4-byte boundary.
pub fn data_digest(segments: &[&[u8]]) -> u32 {
    let mut crc = 0;
    let mut len = 0usize;
    for s in segments {
        crc = crc32c_append(crc, s);
        len += s.len();
    }
    let pad = crate::pdu::pad_len(len);
    if pad > 0 {
        crc = crc32c_append(crc, &[0u8; 3][..pad]);
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known answers from RFC 3720 Appendix B.4; the RFC prints the CRC bytes in wire order,
    /// which is the little-endian encoding of the value.
    #[test]
    fn rfc3720_b4_known_answers() {
        assert_eq!(crc32c(&[0u8; 32]).to_le_bytes(), [0xaa, 0x36, 0x91, 0x8a]);
        assert_eq!(
            crc32c(&[0xffu8; 32]).to_le_bytes(),
            [0x43, 0xab, 0xa8, 0x62]
        );
        let inc: Vec<u8> = (0u8..32).collect();
        assert_eq!(crc32c(&inc).to_le_bytes(), [0x4e, 0x79, 0xdd, 0x46]);
        let dec: Vec<u8> = (0u8..32).rev().collect();
        assert_eq!(crc32c(&dec).to_le_bytes(), [0x5c, 0xdb, 0x3f, 0x11]);
        let scsi_read: [u8; 48] = [
            0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x00, 0x14,
            0x00, 0x00, 0x00, 0x18, 0x28, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00,
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        ];
        assert_eq!(crc32c(&scsi_read).to_le_bytes(), [0x56, 0x3a, 0x96, 0xd9]);
    }

    #[test]
    fn data_digest_includes_padding() {
        let d = b"abcde";
        assert_eq!(data_digest(&[d]), crc32c(b"abcde\0\0\0"));
        assert_eq!(data_digest(&[b"ab", b"cde"]), crc32c(b"abcde\0\0\0"));
    }
}
