//! `multipart/form-data` bodies by their parts, whatever the boundary: a client that retries an
//! upload picks a new boundary each time (curl does), and the boundary is framing, not intent.
//!
//! The canonical form lists each part's header lines (names lowercased, values trimmed, lines
//! sorted) and its content, each length-prefixed. A body that is not well-formed multipart
//! (RFC 2046 §5.1.1: no boundary parameter, a part without its header block's end, no closing
//! delimiter) has no canonical form and is hashed as raw bytes.

/// The canonical form of a multipart body, if `content_type` is `multipart/form-data` with a
/// boundary and `body` is well formed.
pub(super) fn canonicalise(content_type: &str, body: &[u8]) -> Option<Vec<u8>> {
    let boundary = boundary(content_type)?;
    let delimiter = [b"--", boundary.as_bytes()].concat();
    let mut out = Vec::with_capacity(body.len());
    // The first delimiter opens the body or follows the preamble's CRLF.
    let mut at = if body.starts_with(&delimiter) {
        0
    } else {
        find(body, &[b"\r\n", &delimiter[..]].concat())? + 2
    };
    loop {
        let rest = &body[at + delimiter.len()..];
        if rest.starts_with(b"--") {
            return Some(out); // the close delimiter; the epilogue is ignored
        }
        let line_end = find(rest, b"\r\n")?;
        if rest[..line_end].iter().any(|b| !matches!(b, b' ' | b'\t')) {
            return None; // only transport padding may follow a delimiter
        }
        let part_start = at + delimiter.len() + line_end + 2;
        let next = &[b"\r\n", &delimiter[..]].concat();
        let part_len = find(&body[part_start..], next)?;
        write_part(&body[part_start..part_start + part_len], &mut out)?;
        at = part_start + part_len + 2;
    }
}

/// The `boundary` parameter of a `multipart/form-data` content type.
fn boundary(content_type: &str) -> Option<String> {
    let mut params = content_type.split(';');
    let essence = params.next()?.trim();
    if !essence.eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    let value = params.find_map(|param| {
        let (name, value) = param.split_once('=')?;
        name.trim()
            .eq_ignore_ascii_case("boundary")
            .then(|| value.trim())
    })?;
    let value = value
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(value);
    (1..=70).contains(&value.len()).then(|| value.to_owned())
}

fn write_part(part: &[u8], out: &mut Vec<u8>) -> Option<()> {
    let (headers, content) = if let Some(content) = part.strip_prefix(b"\r\n") {
        (&[][..], content)
    } else {
        let end = find(part, b"\r\n\r\n")?;
        (&part[..end], &part[end + 4..])
    };
    let mut lines: Vec<Vec<u8>> = Vec::new();
    for line in headers.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        match (line.first(), lines.last_mut()) {
            // A folded line continues the header before it.
            (Some(b' ' | b'\t'), Some(last)) => {
                last.push(b' ');
                last.extend_from_slice(line.trim_ascii());
            }
            _ => {
                let colon = line.iter().position(|&b| b == b':')?;
                let mut header = line[..colon].trim_ascii().to_ascii_lowercase();
                header.push(b':');
                header.extend_from_slice(line[colon + 1..].trim_ascii());
                lines.push(header);
            }
        }
    }
    lines.sort();
    push_field(out, &lines.join(&b'\n'));
    push_field(out, content);
    Some(())
}

fn push_field(out: &mut Vec<u8>, field: &[u8]) {
    out.extend_from_slice(&(field.len() as u64).to_be_bytes());
    out.extend_from_slice(field);
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(boundary: &str, parts: &[(&str, &str)]) -> Vec<u8> {
        let mut body = Vec::new();
        for (disposition, content) in parts {
            body.extend_from_slice(
                format!("--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n{content}\r\n")
                    .as_bytes(),
            );
        }
        body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
        body
    }

    #[test]
    fn the_boundary_does_not_count_and_the_parts_do() {
        let ct = |b: &str| format!("multipart/form-data; boundary={b}");
        let parts = [
            ("form-data; name=\"a\"", "1"),
            ("form-data; name=\"f\"", "x\r\ny"),
        ];
        let one = canonicalise(&ct("XyZ1"), &form("XyZ1", &parts)).unwrap();
        let two = canonicalise(&ct("\"other-9\""), &form("other-9", &parts)).unwrap();
        assert_eq!(one, two);
        let changed = [("form-data; name=\"a\"", "2"), parts[1]];
        assert_ne!(one, canonicalise(&ct("B"), &form("B", &changed)).unwrap());
    }

    #[test]
    fn malformed_bodies_have_no_canonical_form() {
        let ct = "multipart/form-data; boundary=B";
        assert!(canonicalise(ct, b"--B\r\nContent-Disposition: x\r\n\r\nno close").is_none());
        assert!(canonicalise(ct, b"no delimiter at all").is_none());
        assert!(canonicalise("multipart/form-data", &form("B", &[("x", "1")])).is_none());
        assert!(canonicalise("multipart/mixed; boundary=B", &form("B", &[("x", "1")])).is_none());
        assert!(canonicalise(ct, b"--B\r\nno header end\r\n--B--").is_none());
    }

    #[test]
    fn a_preamble_and_an_epilogue_are_ignored() {
        let ct = "multipart/form-data; boundary=B";
        let plain = form("B", &[("form-data; name=\"a\"", "1")]);
        let mut framed = b"preamble\r\n".to_vec();
        framed.extend_from_slice(&plain);
        framed.extend_from_slice(b"epilogue");
        assert_eq!(canonicalise(ct, &plain), canonicalise(ct, &framed));
    }
}
