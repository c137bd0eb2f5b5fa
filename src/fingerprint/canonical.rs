//! Canonical JSON text that keeps every number's exact value.
//!
//! (Over 400 lines: a single-pass JSON reader, kept whole so that its number rules sit beside its grammar.)
//!
//! A `serde_json::Value` (without serde_json's `arbitrary_precision` feature, which a library
//! cannot enable without changing `Value` for the whole application) holds numbers as
//! `f64`, `i64` or `u64`, so `100000000000000000001` and `100000000000000000000` become the
//! same value. A fingerprint must tell them apart, so this module reads the JSON text itself.
//!
//! The canonical text is the one the [parent module](super#canonical-json) describes, numbers
//! by [`write_number`]'s rule. [`canonicalise`] returns `None`, and the caller hashes the raw
//! bytes, for anything that is not JSON by RFC 8259, for arrays and objects nested
//! [`DEPTH_LIMIT`] deep, and for a number whose exponent has more than [`MAX_EXPONENT_DIGITS`]
//! significant digits.
//!
//! It reads the body once, iteratively (no recursion), into flat tables of ranges, sorting each
//! object's members when the object closes, and writes the result in a second iterative pass:
//! time linear in the body plus the key sorting, memory linear in the body.

use std::io::Write;
use std::ops::Range;

/// Arrays and objects nested this deep are refused. serde_json's recursion limit of 128 refuses
/// the same documents (it accepts 127 levels), so the same bodies fall back to raw bytes as
/// before.
pub(super) const DEPTH_LIMIT: usize = 128;

/// How many digits, after its leading zeros, a number's exponent may have. Up to this the
/// exponent fits an `i128` with room for the digit counts added to it; beyond it the number
/// would need big integers to normalise, and no real command has such an exponent.
pub(super) const MAX_EXPONENT_DIGITS: usize = 30;

/// The canonical text of a JSON document, or `None` when the body is not one this module
/// accepts (see the module documentation).
pub(super) fn canonicalise(body: &[u8]) -> Option<Vec<u8>> {
    let input = std::str::from_utf8(body).ok()?;
    let mut parser = Parser {
        input,
        pos: 0,
        text: Vec::with_capacity(body.len()),
        keys: String::new(),
        members: Vec::new(),
        pending: Vec::new(),
        scratch: String::new(),
        digits: Vec::new(),
    };
    let root = parser.document()?;
    let mut out = Vec::with_capacity(parser.text.len() + parser.keys.len() + 16);
    parser.write(&root, &mut out)?;
    Some(out)
}

/// A parsed value.
#[derive(Debug)]
enum Node {
    /// A string, number or literal: its canonical text, `Parser::text[range]`.
    Text(Range<usize>),
    /// An array: its items, `Parser::members[range]`.
    Array(Range<usize>),
    /// An object: its members, `Parser::members[range]`, sorted by key without duplicates.
    Object(Range<usize>),
}

/// An array item or an object member.
#[derive(Debug)]
struct Member {
    /// The decoded key, `Parser::keys[range]`; empty for array items.
    key: Range<usize>,
    value: Node,
}

/// An array or object whose closing bracket has not been read yet.
struct Open {
    object: bool,
    /// Where its members start in `Parser::pending`.
    first: usize,
    /// The key of the member being read (objects only).
    key: Range<usize>,
}

struct Parser<'a> {
    input: &'a str,
    pos: usize,
    /// Canonical text of every scalar, in document order.
    text: Vec<u8>,
    /// Decoded object keys, compared when sorting and escaped when written.
    keys: String,
    /// Members of closed containers, each container's contiguous.
    members: Vec<Member>,
    /// Members of the containers still open, the innermost's last.
    pending: Vec<Member>,
    /// The string being decoded.
    scratch: String,
    /// The number being normalised: its integer and fraction digits.
    digits: Vec<u8>,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.input.as_bytes().get(self.pos).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let byte = self.peek()?;
        self.pos += 1;
        Some(byte)
    }

    fn eat(&mut self, byte: u8) -> bool {
        let found = self.peek() == Some(byte);
        if found {
            self.pos += 1;
        }
        found
    }

    /// RFC 8259's whitespace; nothing else (no BOM, no vertical tab), as serde_json.
    fn skip_whitespace(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    /// The whole body: one value and nothing after it but whitespace.
    ///
    /// A loop over an explicit stack of open containers instead of recursion, so nesting costs
    /// heap, not stack, and the depth limit is a plain comparison.
    fn document(&mut self) -> Option<Node> {
        let mut open: Vec<Open> = Vec::new();
        'value: loop {
            self.skip_whitespace();
            let mut node = match self.peek()? {
                bracket @ (b'{' | b'[') => {
                    self.pos += 1;
                    if open.len() + 1 >= DEPTH_LIMIT {
                        return None;
                    }
                    let object = bracket == b'{';
                    self.skip_whitespace();
                    if self.eat(if object { b'}' } else { b']' }) {
                        let empty = self.members.len()..self.members.len();
                        if object {
                            Node::Object(empty)
                        } else {
                            Node::Array(empty)
                        }
                    } else {
                        let key = if object { self.key()? } else { 0..0 };
                        open.push(Open {
                            object,
                            first: self.pending.len(),
                            key,
                        });
                        continue 'value;
                    }
                }
                _ => self.scalar()?,
            };
            // `node` is complete: it is a member of the innermost open container, and may be
            // the last one of that container and of those around it.
            loop {
                let Some(top) = open.last_mut() else {
                    self.skip_whitespace();
                    return (self.pos == self.input.len()).then_some(node);
                };
                self.pending.push(Member {
                    key: top.key.clone(),
                    value: node,
                });
                self.skip_whitespace();
                match (self.next()?, top.object) {
                    (b',', true) => {
                        top.key = self.key()?;
                        continue 'value;
                    }
                    (b',', false) => continue 'value,
                    (b'}', true) | (b']', false) => {}
                    _ => return None,
                }
                let closed = open.pop()?;
                node = self.close(closed)?;
            }
        }
    }

    /// An object key and the colon after it; the cursor is just past `{` or `,`.
    fn key(&mut self) -> Option<Range<usize>> {
        self.skip_whitespace();
        if self.peek() != Some(b'"') {
            return None;
        }
        self.string()?;
        let start = self.keys.len();
        self.keys.push_str(&self.scratch);
        self.skip_whitespace();
        self.eat(b':').then_some(start..self.keys.len())
    }

    /// Moves a closed container's members from `pending` to `members`; an object's sorted by
    /// decoded key, the last of equal keys kept (what serde_json's `Value` keeps).
    fn close(&mut self, open: Open) -> Option<Node> {
        let start = self.members.len();
        // Checked here: `drain` would panic on a range out of bounds.
        let closed = self.pending.get_mut(open.first..)?;
        if !open.object {
            self.members.extend(self.pending.drain(open.first..));
            return Some(Node::Array(start..self.members.len()));
        }
        let keys = &self.keys;
        // Stable, so equal keys stay in document order and the last one is the one kept.
        closed.sort_by(|a, b| keys.get(a.key.clone()).cmp(&keys.get(b.key.clone())));
        for member in self.pending.drain(open.first..) {
            let kept = self.members.get_mut(start..).and_then(<[Member]>::last_mut);
            match kept {
                Some(kept) if keys.get(kept.key.clone()) == keys.get(member.key.clone()) => {
                    *kept = member;
                }
                _ => self.members.push(member),
            }
        }
        Some(Node::Object(start..self.members.len()))
    }

    /// A string, number or literal, written to `text` in canonical form.
    fn scalar(&mut self) -> Option<Node> {
        let start = self.text.len();
        match self.peek()? {
            b'"' => {
                self.string()?;
                serde_json::to_writer(&mut self.text, &self.scratch).ok()?;
            }
            b'-' | b'0'..=b'9' => self.number()?,
            _ => {
                let rest = self.input.get(self.pos..)?;
                let literal = ["true", "false", "null"]
                    .into_iter()
                    .find(|literal| rest.starts_with(literal))?;
                self.pos += literal.len();
                self.text.extend_from_slice(literal.as_bytes());
            }
        }
        Some(Node::Text(start..self.text.len()))
    }

    /// Decodes the string at the cursor (on its opening quote) into `scratch`.
    fn string(&mut self) -> Option<()> {
        self.scratch.clear();
        self.pos += 1;
        loop {
            let run = self.pos;
            while matches!(self.peek(), Some(byte) if byte != b'"' && byte != b'\\' && byte >= 0x20)
            {
                self.pos += 1;
            }
            // The run ends at an ASCII byte or the end, so it is whole characters.
            self.scratch.push_str(self.input.get(run..self.pos)?);
            let decoded = match self.next()? {
                b'"' => return Some(()),
                b'\\' => match self.next()? {
                    b'"' => '"',
                    b'\\' => '\\',
                    b'/' => '/',
                    b'b' => '\u{8}',
                    b'f' => '\u{c}',
                    b'n' => '\n',
                    b'r' => '\r',
                    b't' => '\t',
                    b'u' => self.unicode_escape()?,
                    _ => return None,
                },
                // A control character, which RFC 8259 allows only escaped.
                _ => return None,
            };
            self.scratch.push(decoded);
        }
    }

    /// The character of a `\u` escape (the cursor just past the `u`): a surrogate pair spans
    /// two escapes; a lone surrogate of either half is refused.
    fn unicode_escape(&mut self) -> Option<char> {
        let first = self.hex4()?;
        let code = if (0xD800..0xDC00).contains(&first) {
            if !(self.eat(b'\\') && self.eat(b'u')) {
                return None;
            }
            let low = self.hex4()?;
            if !(0xDC00..0xE000).contains(&low) {
                return None;
            }
            0x10000 + ((first - 0xD800) << 10) + (low - 0xDC00)
        } else {
            first
        };
        // `None` for a low surrogate on its own.
        char::from_u32(code)
    }

    fn hex4(&mut self) -> Option<u32> {
        let digits = self
            .input
            .as_bytes()
            .get(self.pos..self.pos.checked_add(4)?)?;
        let value = digits.iter().try_fold(0, |value, &digit| {
            Some(value * 16 + char::from(digit).to_digit(16)?)
        })?;
        self.pos += 4;
        Some(value)
    }

    /// A run of ASCII digits at the cursor (possibly empty).
    fn digits(&mut self) -> &'a [u8] {
        let start = self.pos;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.pos += 1;
        }
        self.input
            .as_bytes()
            .get(start..self.pos)
            .unwrap_or_default()
    }

    /// A number by RFC 8259's grammar, normalised to sign, significant digits and power of
    /// ten, and written by [`write_number`].
    fn number(&mut self) -> Option<()> {
        let negative = self.eat(b'-');
        let int = self.digits();
        // One digit or more, and no leading zero unless the zero is all there is.
        if int.is_empty() || (int.len() > 1 && int.first() == Some(&b'0')) {
            return None;
        }
        let fraction = if self.eat(b'.') {
            Some(self.digits()).filter(|digits| !digits.is_empty())?
        } else {
            &[]
        };
        let mut exponent: i128 = 0;
        if self.eat(b'e') || self.eat(b'E') {
            let negative_exponent = self.eat(b'-');
            if !negative_exponent {
                self.eat(b'+');
            }
            let digits = self.digits();
            if digits.is_empty() {
                return None;
            }
            let significant = match digits.iter().position(|&digit| digit != b'0') {
                Some(first) => digits.get(first..)?,
                None => &[],
            };
            if significant.len() > MAX_EXPONENT_DIGITS {
                return None;
            }
            exponent = significant
                .iter()
                .fold(0, |value, &digit| value * 10 + i128::from(digit - b'0'));
            if negative_exponent {
                exponent = -exponent;
            }
        }
        // The value is the integer and fraction digits, read as one integer, times
        // 10^(exponent - fraction digits).
        self.digits.clear();
        self.digits.extend_from_slice(int);
        self.digits.extend_from_slice(fraction);
        let Some(first) = self.digits.iter().position(|&digit| digit != b'0') else {
            self.text.push(b'0');
            return Some(());
        };
        let last = self.digits.iter().rposition(|&digit| digit != b'0')?;
        let trailing_zeros = self.digits.len() - 1 - last;
        let power = exponent
            .checked_sub(i128::try_from(fraction.len()).ok()?)?
            .checked_add(i128::try_from(trailing_zeros).ok()?)?;
        write_number(
            negative,
            self.digits.get(first..=last)?,
            power,
            &mut self.text,
        )
    }

    /// Writes `root` in canonical form: a loop over an explicit stack, like [`Self::document`].
    fn write(&self, root: &Node, out: &mut Vec<u8>) -> Option<()> {
        /// A container being written: the members still to write.
        struct Cursor {
            members: Range<usize>,
            first: usize,
            object: bool,
        }
        let mut stack: Vec<Cursor> = Vec::new();
        let mut next = Some(root);
        loop {
            match next.take() {
                Some(Node::Text(text)) => out.extend_from_slice(self.text.get(text.clone())?),
                Some(node @ (Node::Array(members) | Node::Object(members))) => {
                    let object = matches!(node, Node::Object(_));
                    out.push(if object { b'{' } else { b'[' });
                    stack.push(Cursor {
                        members: members.clone(),
                        first: members.start,
                        object,
                    });
                }
                None => {}
            }
            let Some(top) = stack.last_mut() else {
                return Some(());
            };
            let Some(i) = top.members.next() else {
                out.push(if top.object { b'}' } else { b']' });
                stack.pop();
                continue;
            };
            if i > top.first {
                out.push(b',');
            }
            let member = self.members.get(i)?;
            if top.object {
                serde_json::to_writer(&mut *out, self.keys.get(member.key.clone())?).ok()?;
                out.push(b':');
            }
            next = Some(&member.value);
        }
    }
}

/// Writes the number ±`digits` × 10^`power`, where `digits` are its significant digits (no
/// leading or trailing zeros, at least one digit), in canonical form:
///
/// - an integer from −2^63 to 2^64 − 1 as plain decimal digits, with `-` if negative (what
///   serde_json writes for an `i64` or `u64`);
/// - any other value as `digits`, `e` and `power` in decimal, with `-` before the digits if
///   negative and before the power if negative: `15e-1` for 1.5, `-1e-1` for −0.1, `1e20`,
///   `100000000000000000001e0`.
///
/// Zero, the one number with no significant digit, is written `0` by the caller, whatever its
/// sign or exponent. Either form reads back as exactly the value it was written from, so
/// different values never share a text; and the form depends on the value alone, so equal
/// values always do.
fn write_number(negative: bool, digits: &[u8], power: i128, out: &mut Vec<u8>) -> Option<()> {
    if negative {
        out.push(b'-');
    }
    match plain_zeros(negative, digits, power) {
        Some(zeros) => {
            out.extend_from_slice(digits);
            out.resize(out.len() + zeros, b'0');
        }
        None => {
            out.extend_from_slice(digits);
            write!(out, "e{power}").ok()?;
        }
    }
    Some(())
}

/// How many zeros follow `digits` when ±`digits` × 10^`power` is an integer in `i64` or `u64`
/// range; `None` otherwise.
fn plain_zeros(negative: bool, digits: &[u8], power: i128) -> Option<usize> {
    /// 2^64 − 1 has 20 digits: longer integers are out of range.
    const MAX_PLAIN_DIGITS: usize = 20;
    let zeros = usize::try_from(power).ok()?;
    if digits.len().checked_add(zeros)? > MAX_PLAIN_DIGITS {
        return None;
    }
    // At most 20 digits: below 10^20, well within u128.
    let magnitude = digits
        .iter()
        .chain(std::iter::repeat_n(&b'0', zeros))
        .fold(0u128, |value, &digit| value * 10 + u128::from(digit - b'0'));
    let limit = if negative {
        1 << 63
    } else {
        u128::from(u64::MAX)
    };
    (magnitude <= limit).then_some(zeros)
}

#[cfg(test)]
mod tests;
