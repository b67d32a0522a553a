//! Rewriting headers across the proxy hop: pure functions of the message they are given.
//!
//! RFC 9110 §7.6.1: a proxy removes the fields that describe one connection (`Connection`,
//! every field that `Connection` names, and the well-known hop-by-hop fields) before it
//! forwards a message. corral also sets the framing itself, since it forwards the body it
//! read and re-frames the reply, and owns the `X-Fleet-*` names.

use pingora_core::Result;
use pingora_http::{RequestHeader, ResponseHeader};

/// Fields that describe one connection, never forwarded in either direction.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Fields corral sets itself on the way to a node: the framing of the body it read (so also
/// `Expect`: the client's 100-continue was answered when corral read the body) and the node's
/// own `Host`.
const REFRAMED_REQUEST: &[&str] = &["content-length", "expect", "host"];

/// Whether `name` (lower case, as `http` stores it) must not cross the hop, given the tokens
/// of the message's `Connection` fields.
fn is_hop_by_hop(name: &str, connection_named: &[String]) -> bool {
    HOP_BY_HOP.contains(&name) || connection_named.iter().any(|n| n == name)
}

/// The field names listed in a message's `Connection` fields, lower-cased.
fn connection_named(headers: &http::HeaderMap) -> Vec<String> {
    headers
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|token| token.trim().to_ascii_lowercase())
        .filter(|token| !token.is_empty())
        .collect()
}

/// The client's request as a node should see it: the same method, path and end-to-end
/// headers, less the hop-by-hop ones, the router's own `X-Fleet-*` (a client must not be able
/// to forge them) and, when corral checked the client's key itself, the key (`Authorization`,
/// or Anthropic clients' `x-api-key`); with the
/// node's `host` and the exact length of the body corral sends.
pub fn upstream_request(
    client: &RequestHeader,
    host: &http::HeaderValue,
    body_len: usize,
    strip_auth: bool,
) -> Result<RequestHeader> {
    let path = client.uri.path_and_query().map_or("/", |p| p.as_str());
    // Without a map of the names' case: every name below is an `http::HeaderName`, which
    // Pingora would enter in that map as its own title case ("Content-Type") or lower case,
    // and that is how it writes names that have no map. So the node reads the same bytes,
    // and no second map is built and filled per request.
    let mut request = RequestHeader::build_no_case(
        client.method.clone(),
        path.as_bytes(),
        Some(client.headers.len()),
    )?;
    let named = connection_named(&client.headers);
    for (name, value) in client.headers.iter() {
        let n = name.as_str();
        if is_hop_by_hop(n, &named)
            || REFRAMED_REQUEST.contains(&n)
            || n.starts_with("x-fleet-")
            || (strip_auth && (n == "authorization" || n == "x-api-key"))
        {
            continue;
        }
        request.append_header(name.clone(), value.clone())?;
    }
    request.insert_header(http::header::HOST, host.clone())?;
    request.insert_header(http::header::CONTENT_LENGTH, body_len)?;
    Ok(request)
}

/// A node's reply header as the client should see it, before corral adds its `X-Fleet-*`
/// headers: the end-to-end fields, the node's `Content-Length` when it sent one, and
/// otherwise chunked framing for a client that speaks HTTP/1.1 (an HTTP/1.0 client reads
/// to the close).
pub fn downstream_reply(
    upstream: &ResponseHeader,
    client_is_http11: bool,
) -> Result<ResponseHeader> {
    // Made anew with room for corral's own fields, rather than cloned from the node's: a
    // clone has no room to spare, and growing its maps for the `X-Fleet-*` fields cost more
    // than entering the node's few fields again (issue 13).
    let mut header = ResponseHeader::build(upstream.status, Some(upstream.headers.len() + 6))?;
    let named = connection_named(&upstream.headers);
    for (name, value) in upstream.headers.iter() {
        let n = name.as_str();
        // The node's own `X-Fleet-*` would be mistaken for corral's.
        if is_hop_by_hop(n, &named) || n == "content-length" || n.starts_with("x-fleet-") {
            continue;
        }
        header.append_header(name.clone(), value.clone())?;
    }
    if let Some(length) = upstream.headers.get(http::header::CONTENT_LENGTH) {
        header.insert_header(http::header::CONTENT_LENGTH, length.clone())?;
    } else if client_is_http11 {
        header.insert_header(http::header::TRANSFER_ENCODING, "chunked")?;
    }
    Ok(header)
}

/// The `X-Fleet-Score` text of a score: exactly `format!("{score:.1}")`, which it replaces on
/// every reply because float formatting at a fixed precision was a measurable part of
/// writing the reply header (issue 13). Away from a tie (a tenth ending in 5 in the next
/// digit), the score times ten rounds to the same integer as the exact decimal does; ties,
/// NaN, infinities and scores past a billion take the formatter.
pub fn score_text(score: f64) -> String {
    let tenths = (score * 10.0).abs();
    // Below 1e9 the product's rounding error (a relative 2^-53) is under 1e-6.
    let in_range = tenths < 1e9; // false for NaN too
    if !in_range || (tenths.fract() - 0.5).abs() < 1e-6 {
        return format!("{score:.1}");
    }
    // In range: below 1e9, so the cast is exact after rounding.
    let tenths = tenths.round() as u64;
    let mut text = String::with_capacity(16);
    if score.is_sign_negative() {
        text.push('-');
    }
    push_decimal(&mut text, tenths / 10);
    text.push('.');
    push_decimal(&mut text, tenths % 10);
    text
}

fn push_decimal(text: &mut String, n: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    let mut n = n;
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    text.extend(digits[at..].iter().map(|d| char::from(*d)));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(headers: &[(&str, &str)]) -> RequestHeader {
        let mut r = RequestHeader::build("POST", b"/api/chat?x=1", None).unwrap();
        for (n, v) in headers {
            r.append_header(n.to_string(), *v).unwrap();
        }
        r
    }

    fn host(text: &'static str) -> http::HeaderValue {
        http::HeaderValue::from_static(text)
    }

    fn names(h: &http::HeaderMap) -> Vec<String> {
        let mut v: Vec<String> = h.keys().map(|k| k.as_str().to_string()).collect();
        v.sort();
        v
    }

    #[test]
    fn hop_by_hop_and_connection_named_fields_are_dropped() {
        let req = client(&[
            ("Connection", "keep-alive, X-Trace-Hop"),
            ("Connection", "Foo"),
            ("Keep-Alive", "timeout=5"),
            ("X-Trace-Hop", "1"),
            ("Foo", "bar"),
            ("TE", "trailers"),
            ("Upgrade", "websocket"),
            ("Proxy-Authorization", "Basic x"),
            ("Transfer-Encoding", "chunked"),
            ("Expect", "100-continue"),
            ("Content-Type", "application/json"),
            ("User-Agent", "ollama-rs"),
        ]);
        let up = upstream_request(&req, &host("10.0.0.2:11434"), 42, false).unwrap();
        assert_eq!(
            names(&up.headers),
            ["content-length", "content-type", "host", "user-agent"]
        );
        assert_eq!(up.headers["content-length"], "42");
        assert_eq!(up.headers["host"], "10.0.0.2:11434");
        assert_eq!(up.uri.path_and_query().unwrap().as_str(), "/api/chat?x=1");
        assert_eq!(up.method, http::Method::POST);
    }

    #[test]
    fn the_node_reads_the_names_in_title_case_where_pingora_knows_one_else_lower_case() {
        let req = client(&[
            ("content-type", "application/json"),
            ("User-Agent", "ollama-rs"),
            ("X-Custom-Thing", "1"),
            ("Accept", "*/*"),
            ("accept", "text/plain"),
        ]);
        let up = upstream_request(&req, &host("10.0.0.2:11434"), 42, false).unwrap();
        let wire = pingora_core::protocols::http::v1::client::http_req_header_to_wire(&up).unwrap();
        assert_eq!(
            std::str::from_utf8(&wire).unwrap(),
            "POST /api/chat?x=1 HTTP/1.1\r\n\
             Content-Type: application/json\r\n\
             user-agent: ollama-rs\r\n\
             x-custom-thing: 1\r\n\
             accept: */*\r\n\
             accept: text/plain\r\n\
             Host: 10.0.0.2:11434\r\n\
             Content-Length: 42\r\n\r\n"
        );
    }

    #[test]
    fn fleet_headers_from_clients_are_dropped_and_auth_only_when_asked() {
        let req = client(&[
            ("X-Fleet-Node", "forged"),
            ("x-fleet-explain", "1"),
            ("Authorization", "Bearer k"),
            ("x-api-key", "k"),
            ("Host", "router:11435"),
            ("Content-Length", "999"),
        ]);
        let kept = upstream_request(&req, &host("n:1"), 3, false).unwrap();
        assert_eq!(
            names(&kept.headers),
            ["authorization", "content-length", "host", "x-api-key"]
        );
        assert_eq!(kept.headers["host"], "n:1");
        assert_eq!(kept.headers["content-length"], "3");
        let stripped = upstream_request(&req, &host("n:1"), 3, true).unwrap();
        assert_eq!(names(&stripped.headers), ["content-length", "host"]);
    }

    fn reply(headers: &[(&str, &str)]) -> ResponseHeader {
        let mut r = ResponseHeader::build(200, None).unwrap();
        for (n, v) in headers {
            r.append_header(n.to_string(), *v).unwrap();
        }
        r
    }

    #[test]
    fn replies_keep_end_to_end_fields_and_their_length() {
        let up = reply(&[
            ("Content-Type", "application/json"),
            ("Content-Length", "17"),
            ("Connection", "close, X-Node-Debug"),
            ("X-Node-Debug", "1"),
            ("X-Fleet-Node", "node-says"),
            ("Date", "Mon, 30 Nov 2026 22:00:00 GMT"),
        ]);
        let down = downstream_reply(&up, true).unwrap();
        assert_eq!(
            names(&down.headers),
            ["content-length", "content-type", "date"]
        );
        assert_eq!(down.headers["content-length"], "17");
        assert_eq!(down.status, 200);
    }

    #[test]
    fn a_reply_without_length_is_chunked_for_http11_only() {
        let up = reply(&[
            ("Content-Type", "application/x-ndjson"),
            ("Transfer-Encoding", "chunked"),
        ]);
        let down = downstream_reply(&up, true).unwrap();
        assert_eq!(down.headers["transfer-encoding"], "chunked");
        let down = downstream_reply(&up, false).unwrap();
        assert_eq!(names(&down.headers), ["content-type"]);
    }

    #[test]
    fn score_text_is_the_formatter_s_text() {
        for score in [
            0.0,
            -0.0,
            0.04,
            -0.04,
            0.05,
            0.15,
            0.25,
            0.35,
            0.95,
            -0.95,
            1.0,
            99.95,
            100.0,
            -50.0,
            123.456,
            1e8,
            1e9,
            1e300,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::MIN_POSITIVE,
            0.1 + 0.2,
        ] {
            assert_eq!(score_text(score), format!("{score:.1}"), "{score:e}");
        }
    }

    proptest::proptest! {
        /// Any score, and scores on and next to every tie of the range corral's scores use.
        #[test]
        fn score_text_matches_format(score in proptest::num::f64::ANY, tie in -2000i64..2000, ulps in -2i64..=2) {
            proptest::prop_assert_eq!(score_text(score), format!("{score:.1}"));
            let near_tie = f64::from_bits(((tie as f64 + 0.5) / 10.0).to_bits().wrapping_add_signed(ulps));
            proptest::prop_assert_eq!(score_text(near_tie), format!("{near_tie:.1}"));
        }
    }
}
