//! The one thing corral needs from a `multipart/form-data` body: a small text field (the
//! `model` of an audio transcription). The body is forwarded unchanged.

/// The value of the form field `name`, when the body is `multipart/form-data` with that
/// field. `None` for other content types, a missing boundary or field, or a malformed body.
pub fn form_field<'b>(content_type: &str, body: &'b [u8], name: &str) -> Option<&'b [u8]> {
    let boundary = boundary(content_type)?;
    let delimiter = [b"--", boundary.as_bytes()].concat();
    let mut rest = body;
    // Everything before the first delimiter is preamble.
    let start = find(rest, &delimiter)?;
    rest = &rest[start + delimiter.len()..];
    loop {
        // `--` after a delimiter closes the body.
        if rest.starts_with(b"--") {
            return None;
        }
        let end = find(rest, &delimiter)?;
        let part = &rest[..end];
        rest = &rest[end + delimiter.len()..];
        let part = part.strip_prefix(b"\r\n").unwrap_or(part);
        let split = find(part, b"\r\n\r\n")?;
        let (head, content) = (&part[..split], &part[split + 4..]);
        // The CRLF before the next delimiter belongs to the delimiter.
        let content = content.strip_suffix(b"\r\n").unwrap_or(content);
        if field_name(head).is_some_and(|n| n == name.as_bytes()) {
            return Some(content);
        }
    }
}

/// `boundary=...` of a multipart content type, unquoted.
fn boundary(content_type: &str) -> Option<&str> {
    let (kind, params) = content_type.split_once(';')?;
    if !kind.trim().eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    params.split(';').find_map(|p| {
        let (key, value) = p.split_once('=')?;
        if !key.trim().eq_ignore_ascii_case("boundary") {
            return None;
        }
        let value = value.trim().trim_matches('"');
        (!value.is_empty()).then_some(value)
    })
}

/// The `name="..."` of a part's `Content-Disposition: form-data` header.
fn field_name(head: &[u8]) -> Option<&[u8]> {
    head.split(|b| *b == b'\n').find_map(|line| {
        let line = line.trim_ascii();
        let (header, value) = line.split_at(line.iter().position(|b| *b == b':')?);
        if !header.eq_ignore_ascii_case(b"content-disposition") {
            return None;
        }
        let at = find(value, b"name=\"")? + 6;
        // `filename="..."` also contains `name="`: require a separator before it.
        if at >= 7 && !matches!(value[at - 7], b';' | b' ' | b':') {
            return None;
        }
        let len = value[at..].iter().position(|b| *b == b'"')?;
        Some(&value[at..at + len])
    })
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || haystack.len() < needle.len() {
        return None;
    }
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CT: &str = "multipart/form-data; boundary=\"XyZ\"";

    fn form(parts: &[(&str, &str)]) -> Vec<u8> {
        let mut body = Vec::new();
        for (head, content) in parts {
            body.extend_from_slice(format!("--XyZ\r\n{head}\r\n\r\n{content}\r\n").as_bytes());
        }
        body.extend_from_slice(b"--XyZ--\r\n");
        body
    }

    #[test]
    fn finds_the_model_after_a_file() {
        let body = form(&[
            (
                "Content-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav",
                "RIFF....data",
            ),
            (
                "Content-Disposition: form-data; name=\"model\"",
                "whisper:small",
            ),
        ]);
        assert_eq!(form_field(CT, &body, "model"), Some(&b"whisper:small"[..]));
        assert_eq!(form_field(CT, &body, "language"), None);
    }

    #[test]
    fn filename_is_not_a_name() {
        let body = form(&[("Content-Disposition: form-data; filename=\"model\"", "x")]);
        assert_eq!(form_field(CT, &body, "model"), None);
    }

    #[test]
    fn other_bodies_have_no_fields() {
        let body = form(&[("Content-Disposition: form-data; name=\"model\"", "m")]);
        assert_eq!(form_field("application/json", &body, "model"), None);
        assert_eq!(form_field("multipart/form-data", &body, "model"), None);
        assert_eq!(form_field(CT, b"garbage", "model"), None);
        assert_eq!(form_field(CT, b"--XyZ\r\nno blank line", "model"), None);
    }
}
