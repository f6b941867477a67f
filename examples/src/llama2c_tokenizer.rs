//! llama2.c's tokenizer format (`tok512.bin`): a SentencePiece-style BPE vocabulary with
//! scores and byte-fallback tokens `<0xNN>`. Encoding and decoding follow `run.c`'s `encode`
//! and `decode` (Karpathy, llama2.c, MIT), which define the token ids the checkpoint was
//! trained on; no tokenizer library reads this format.

use std::collections::HashMap;
use std::path::Path;

use crate::training::read_data;

/// Beginning of a sequence.
pub const BOS: u32 = 1;
/// End of a sequence.
pub const EOS: u32 = 2;
/// Byte `b` without a piece of its own is token `b + 3` (`<0x00>` is id 3).
const BYTE_OFFSET: u32 = 3;

/// The vocabulary: each token's bytes and merge score.
pub struct Llama2cTokenizer {
    pieces: Vec<Vec<u8>>,
    scores: Vec<f32>,
    ids: HashMap<Vec<u8>, u32>,
    /// Whether a merge can involve a newline: when `\n` has no piece of its own it becomes the
    /// byte token `<0x0A>`, and unless another piece contains that text no merge touches it;
    /// then long texts are encoded line by line (the same ids, in linear time).
    newline_merges: bool,
}

impl Llama2cTokenizer {
    /// Reads `i32 max_token_length`, then `vocab_size` times (`f32` score, `i32` length, bytes).
    ///
    /// # Errors
    /// The file is unreadable or shorter than `vocab_size` entries.
    pub fn from_file(path: &Path, vocab_size: usize) -> Result<Self, String> {
        if vocab_size < 259 {
            return Err(format!(
                "a llama2.c vocabulary has at least 259 tokens (<unk>, BOS, EOS and 256 bytes); the model says {vocab_size}"
            ));
        }
        let bytes = read_data(path)?;
        let short = || {
            format!(
                "{} is not a llama2.c tokenizer of {vocab_size} tokens (too short)",
                path.display()
            )
        };
        let mut at = 4;
        let mut take = |n: usize| -> Result<&[u8], String> {
            let s = bytes.get(at..at + n).ok_or_else(short)?;
            at += n;
            Ok(s)
        };
        let (mut pieces, mut scores) = (Vec::with_capacity(vocab_size), Vec::with_capacity(vocab_size));
        for _ in 0..vocab_size {
            scores.push(f32::from_le_bytes(take(4)?.try_into().expect("4 bytes")));
            let len = i32::from_le_bytes(take(4)?.try_into().expect("4 bytes"));
            let len = usize::try_from(len).map_err(|_| short())?;
            pieces.push(take(len)?.to_vec());
        }
        let ids: HashMap<Vec<u8>, u32> = pieces.iter().enumerate().map(|(i, p)| (p.clone(), i as u32)).collect();
        let byte_token = format!("<0x{:02X}>", b'\n').into_bytes();
        let newline_merges = ids.contains_key(&b"\n"[..])
            || pieces
                .iter()
                .any(|p| *p != byte_token && p.windows(byte_token.len()).any(|w| w == byte_token));
        Ok(Self {
            pieces,
            scores,
            ids,
            newline_merges,
        })
    }

    /// Number of tokens.
    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    /// Token ids of `text`, optionally after [`BOS`]: a dummy-prefix space, then one token per
    /// character (its bytes' tokens if it has none), then repeatedly the adjacent pair whose
    /// merged piece has the best score (the leftmost on ties) is merged.
    pub fn encode(&self, text: &str, bos: bool) -> Vec<u32> {
        let mut out = Vec::new();
        if bos {
            out.push(BOS);
        }
        if text.is_empty() {
            return out;
        }
        // The dummy prefix is part of the first segment: it merges with the first word.
        let text = format!(" {text}");
        if self.newline_merges {
            self.encode_segment(&text, &mut out);
        } else {
            for line in text.split_inclusive('\n') {
                self.encode_segment(line, &mut out);
            }
        }
        out
    }

    /// [`Self::encode`] as llama2.c runs it, on the whole text at once: quadratic in the
    /// text's length, so only for short texts and for checking `encode`.
    pub fn encode_whole(&self, text: &str, bos: bool) -> Vec<u32> {
        let mut out = Vec::new();
        if bos {
            out.push(BOS);
        }
        if !text.is_empty() {
            self.encode_segment(&format!(" {text}"), &mut out);
        }
        out
    }

    fn encode_segment(&self, text: &str, out: &mut Vec<u32>) {
        let mut tokens: Vec<u32> = Vec::with_capacity(text.len());
        let mut buf = [0u8; 4];
        for c in text.chars() {
            let bytes = c.encode_utf8(&mut buf).as_bytes();
            match self.ids.get(bytes) {
                Some(&id) => tokens.push(id),
                None => tokens.extend(bytes.iter().map(|&b| u32::from(b) + BYTE_OFFSET)),
            }
        }
        let mut merged = Vec::new();
        loop {
            let mut best: Option<(f32, usize, u32)> = None;
            for i in 0..tokens.len().saturating_sub(1) {
                merged.clear();
                merged.extend_from_slice(&self.pieces[tokens[i] as usize]);
                merged.extend_from_slice(&self.pieces[tokens[i + 1] as usize]);
                if let Some(&id) = self.ids.get(&merged)
                    && best.is_none_or(|(score, _, _)| self.scores[id as usize] > score)
                {
                    best = Some((self.scores[id as usize], i, id));
                }
            }
            let Some((_, i, id)) = best else { break };
            tokens[i] = id;
            tokens.remove(i + 1);
        }
        out.extend(tokens);
    }

    /// The bytes of `token` when it follows `prev`: a `<0xNN>` token is that byte, and the
    /// leading space of the first piece after [`BOS`] is dropped.
    pub fn decode_piece(&self, prev: u32, token: u32) -> Vec<u8> {
        let piece = &self.pieces[token as usize];
        let piece = if prev == BOS && piece.first() == Some(&b' ') {
            &piece[1..]
        } else {
            &piece[..]
        };
        if let Some(hex) = piece.strip_prefix(b"<0x").and_then(|p| p.strip_suffix(b">"))
            && let Some(byte) = std::str::from_utf8(hex)
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            return vec![byte];
        }
        piece.to_vec()
    }

    /// Text of `tokens` that follow `prev` (e.g. [`BOS`]); invalid UTF-8 is replaced.
    pub fn decode(&self, mut prev: u32, tokens: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &t in tokens {
            bytes.extend(self.decode_piece(prev, t));
            prev = t;
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}
