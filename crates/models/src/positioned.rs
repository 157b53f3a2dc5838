//! A reader that keeps its own position, for readers that ask it often.
//!
//! candle's GGUF reader asks the file's position before every metadata string (to bound its
//! length by the bytes left), and `BufReader::stream_position` is a `lseek` system call each
//! time: Gemma 3's 262 144-token vocabulary made as many calls.

use std::io::{Read, Result, Seek, SeekFrom};

/// `inner` with its position counted as it is read and set as it is sought, so
/// [`Seek::stream_position`] answers without asking `inner`. The position starts at `inner`'s,
/// which must be 0 (a freshly opened file).
#[derive(Debug)]
pub struct Positioned<R> {
    inner: R,
    pos: u64,
}

impl<R> Positioned<R> {
    /// Wraps a reader at position 0.
    pub fn new(inner: R) -> Self {
        Positioned { inner, pos: 0 }
    }
}

impl<R: Read> Read for Positioned<R> {
    fn read(&mut self, buf: &mut [u8]) -> Result<usize> {
        let n = self.inner.read(buf)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl<R: Seek> Seek for Positioned<R> {
    fn seek(&mut self, to: SeekFrom) -> Result<u64> {
        self.pos = self.inner.seek(to)?;
        Ok(self.pos)
    }

    fn stream_position(&mut self) -> Result<u64> {
        Ok(self.pos)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_position_follows_reads_and_seeks() {
        let mut r = Positioned::new(std::io::Cursor::new((0u8..100).collect::<Vec<_>>()));
        let mut buf = [0u8; 7];
        r.read_exact(&mut buf).unwrap();
        assert_eq!(r.stream_position().unwrap(), 7);
        assert_eq!(r.seek(SeekFrom::Current(3)).unwrap(), 10);
        r.read_exact(&mut buf[..2]).unwrap();
        assert_eq!((buf[0], r.stream_position().unwrap()), (10, 12));
        assert_eq!(r.seek(SeekFrom::End(-1)).unwrap(), 99);
        assert_eq!(r.read(&mut buf).unwrap(), 1);
        assert_eq!(r.stream_position().unwrap(), 100);
    }
}
