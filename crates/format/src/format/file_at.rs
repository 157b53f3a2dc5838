//! A trace file read at an offset of its own, through a small window: what the reader, the
//! scans and [`super::frame_digests`] read files with.
//!
//! Bisect walks frame headers far more than it reads payloads: a frame both runs hold
//! identically is passed over, its summary read in its place. A buffered reader costs two
//! system calls for each frame passed over (a seek past the payload, then a read of a buffer's
//! worth). Here a read the window does not hold fills it with one positional read (`pread`) at
//! the offset, and passing over bytes costs nothing, so a frame's header, the small summary
//! frame after it and the next frame's header come in one call. Reads as large as the window
//! (payloads) go to the file directly, into the caller's buffer.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};

/// A file and the offset it is read at (see the module documentation).
pub struct FileAt {
    file: File,
    pos: u64,
    /// The window: `len` bytes of the file from offset `start`.
    window: Box<[u8; FileAt::WINDOW]>,
    start: u64,
    len: usize,
}

impl FileAt {
    /// Bytes of the window: a frame header, a summary frame of a decode step, and the next
    /// header fit.
    const WINDOW: usize = 1 << 10;

    /// Reads `file` from its start.
    pub fn new(file: File) -> Self {
        FileAt { file, pos: 0, window: Box::new([0; FileAt::WINDOW]), start: 0, len: 0 }
    }

    /// Passes over the next `n` bytes, reading nothing.
    pub fn pass(&mut self, n: u32) {
        self.pos += u64::from(n);
    }
}

/// One positional read of `file` into `buf` at offset `pos`.
fn read_at(file: &File, buf: &mut [u8], pos: u64) -> std::io::Result<usize> {
    #[cfg(unix)]
    return std::os::unix::fs::FileExt::read_at(file, buf, pos);
    #[cfg(windows)]
    return std::os::windows::fs::FileExt::seek_read(file, buf, pos);
}

impl Read for FileAt {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let held = self.pos.checked_sub(self.start).filter(|&k| k < self.len as u64);
        let n = match held {
            Some(k) => {
                let from = &self.window[k as usize..self.len];
                let n = from.len().min(buf.len());
                buf[..n].copy_from_slice(&from[..n]);
                n
            }
            None if buf.len() >= FileAt::WINDOW => read_at(&self.file, buf, self.pos)?,
            None => {
                self.len = 0;
                self.len = read_at(&self.file, &mut self.window[..], self.pos)?;
                self.start = self.pos;
                let n = self.len.min(buf.len());
                buf[..n].copy_from_slice(&self.window[..n]);
                n
            }
        };
        self.pos += n as u64;
        Ok(n)
    }
}

impl Seek for FileAt {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        let bad = || std::io::Error::new(std::io::ErrorKind::InvalidInput, "a seek before the start of the file or past 2^64");
        self.pos = match to {
            SeekFrom::Start(n) => n,
            SeekFrom::Current(d) => self.pos.checked_add_signed(d).ok_or_else(bad)?,
            SeekFrom::End(d) => self.file.metadata()?.len().checked_add_signed(d).ok_or_else(bad)?,
        };
        Ok(self.pos)
    }

    fn seek_relative(&mut self, d: i64) -> std::io::Result<()> {
        self.pos = self.pos.checked_add_signed(d).ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "a seek before the start of the file"))?;
        Ok(())
    }

    fn stream_position(&mut self) -> std::io::Result<u64> {
        Ok(self.pos)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads of every size, passes and seeks give the file's bytes at the offset, from the
    /// window or not.
    #[test]
    fn reads_what_the_file_holds_at_the_offset() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let bytes: Vec<u8> = (0..5000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let mut f = FileAt::new(File::open(&path).unwrap());
        let mut pos = 0usize;
        for (k, &(skip, len)) in [(0, 17), (3, 17), (1000, 5), (0, 2000), (10, 1), (0, 900), (4000, 17), (0, 100)].iter().cycle().take(24).enumerate() {
            if k % 5 == 4 {
                f.seek(SeekFrom::Start(pos as u64 + skip as u64)).unwrap();
            } else {
                f.pass(skip);
            }
            pos += skip as usize;
            let mut buf = vec![0u8; len];
            let n = super::super::read_up_to(&mut f, &mut buf).unwrap();
            let want = &bytes[pos.min(bytes.len())..(pos + len).min(bytes.len())];
            assert_eq!(&buf[..n], want, "read {k}: {len} bytes at {pos}");
            pos += n;
            assert_eq!(f.stream_position().unwrap(), pos as u64);
        }
    }
}
