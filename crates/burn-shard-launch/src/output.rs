//! The ranks' output: one thread per pipe reads lines and prefixes or keeps them.

use std::fmt;
use std::io::{BufRead, BufReader, Read, Write};
use std::sync::mpsc::Sender;
use std::thread;

use crate::OutputMode;

/// Which of a rank's streams a line came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputStream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// One line a rank wrote (without its line end; invalid UTF-8 replaced by U+FFFD).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputLine {
    /// The global rank that wrote it.
    pub rank: usize,
    /// The stream it was written to.
    pub stream: OutputStream,
    /// The line's text.
    pub text: String,
}

impl fmt::Display for OutputLine {
    /// `[rank R] text`, as forwarded in [`OutputMode::Prefix`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[rank {}] {}", self.rank, self.text)
    }
}

/// What the reader threads report to the launcher.
pub(crate) enum ReaderEvent {
    /// A line, in [`OutputMode::Capture`].
    Line(OutputLine),
    /// The pipe reached its end: every process holding it has exited.
    Closed,
}

/// Starts a thread that reads `pipe` to its end, line by line, and forwards or keeps each line.
pub(crate) fn spawn_reader(
    pipe: impl Read + Send + 'static,
    rank: usize,
    stream: OutputStream,
    mode: OutputMode,
    events: Sender<ReaderEvent>,
) -> std::io::Result<()> {
    let name = match stream {
        OutputStream::Stdout => format!("rank-{rank}-stdout"),
        OutputStream::Stderr => format!("rank-{rank}-stderr"),
    };
    thread::Builder::new().name(name).spawn(move || {
        let mut reader = BufReader::new(pipe);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match reader.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            let bytes = buf.strip_suffix(b"\n").unwrap_or(&buf);
            let bytes = bytes.strip_suffix(b"\r").unwrap_or(bytes);
            let line = OutputLine {
                rank,
                stream,
                text: String::from_utf8_lossy(bytes).into_owned(),
            };
            match mode {
                OutputMode::Prefix => forward(&line),
                OutputMode::Capture => {
                    let _ = events.send(ReaderEvent::Line(line));
                }
            }
        }
        let _ = events.send(ReaderEvent::Closed);
    })?;
    Ok(())
}

/// Writes one prefixed line with a single write, so lines of different ranks never interleave
/// within a line. Write errors (our own stdout closed) are ignored: the pipe must still be
/// drained, or the rank would block on a full pipe.
fn forward(line: &OutputLine) {
    let text = format!("{line}\n");
    let _ = match line.stream {
        OutputStream::Stdout => std::io::stdout().lock().write_all(text.as_bytes()),
        OutputStream::Stderr => std::io::stderr().lock().write_all(text.as_bytes()),
    };
}
