//! What stands between a request and the pages: authentication (a bearer token or
//! basic authentication against [`TOKEN_ENV`](super::TOKEN_ENV)), the Host check that
//! stops DNS rebinding while no token is set, the origin check and CSRF token of every
//! POST, and the response headers (a Content-Security-Policy that allows no inline
//! script, no framing, no caching) with the server time of each page.

use std::net::SocketAddr;
use std::time::Instant;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;

use super::{Dashboard, PageError, layout};

/// The Content-Security-Policy of every page: scripts and styles from the dashboard's
/// own assets only (no inline script can run, whatever a payload holds), forms posting
/// to the dashboard only, no framing.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                   connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// Who made a request, for the audit log of replays.
#[derive(Debug, Clone)]
pub(crate) struct Operator {
    /// The basic-authentication user name, `token` for a bearer token, or
    /// `anonymous` when no token is configured (loopback only).
    pub who: String,
    /// The client's address, when the server knows it.
    pub peer: Option<SocketAddr>,
}

/// A fresh CSRF token: 256 random bits (two v4 UUIDs, from the OS's generator) in hex.
pub(crate) fn new_csrf_token() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// Compares secrets in time independent of where they differ.
pub(crate) fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Checks the CSRF token a form carried.
///
/// # Errors
/// [`PageError::Forbidden`] when it is missing or wrong.
pub(crate) fn check_csrf(d: &Dashboard, sent: Option<&str>) -> Result<(), PageError> {
    match sent {
        Some(sent) if same_secret(sent.as_bytes(), d.csrf.as_bytes()) => Ok(()),
        Some(_) => Err(PageError::Forbidden(
            "invalid CSRF token: reload the page and submit the form again",
        )),
        None => Err(PageError::Forbidden("missing CSRF token")),
    }
}

/// The host name of a `Host` header value (without the port; IPv6 in brackets kept).
fn host_name(host: &str) -> &str {
    if let Some(end) = host.strip_prefix('[').and_then(|h| h.find(']')) {
        return &host[..end + 2];
    }
    host.rsplit_once(':').map_or(host, |(name, _)| name)
}

/// Whether `host` (a `Host` header value) names this machine's loopback: what a
/// browser sends to a dashboard on 127.0.0.1. A page of another site whose name
/// resolves to 127.0.0.1 (DNS rebinding) sends its own name and is refused.
pub(crate) fn is_loopback_host(host: &str) -> bool {
    let name = host_name(host).to_ascii_lowercase();
    name == "localhost"
        || name == "[::1]"
        || name
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The operator a request authenticates as, or `None` when it does not.
pub(crate) fn authenticate(token: &str, headers: &HeaderMap) -> Option<String> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, rest) = value.split_once(' ')?;
    let rest = rest.trim();
    if scheme.eq_ignore_ascii_case("bearer") {
        return same_secret(rest.as_bytes(), token.as_bytes()).then(|| "token".to_owned());
    }
    if scheme.eq_ignore_ascii_case("basic") {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(rest)
            .ok()?;
        let text = String::from_utf8(decoded).ok()?;
        let (user, password) = text.split_once(':')?;
        if same_secret(password.as_bytes(), token.as_bytes()) {
            let user: String = user.chars().filter(|c| !c.is_control()).take(64).collect();
            return Some(if user.is_empty() {
                "basic".into()
            } else {
                user
            });
        }
    }
    None
}

fn refuse(status: StatusCode, message: &str) -> Response {
    (status, layout::error_page(status, message)).into_response()
}

/// Whether a state-changing request comes from the dashboard's own pages: the
/// browser's `Sec-Fetch-Site` (when sent) is `same-origin`, and the `Origin` (when
/// sent) names the host the request was sent to. The CSRF token is checked as well,
/// by each form's handler.
fn same_origin(headers: &HeaderMap) -> bool {
    let site_ok = headers
        .get("sec-fetch-site")
        .and_then(|v| v.to_str().ok())
        .is_none_or(|site| site == "same-origin" || site == "none");
    let origin_ok = match (
        headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()),
        headers.get(header::HOST).and_then(|v| v.to_str().ok()),
    ) {
        (Some(origin), Some(host)) => origin
            .split_once("://")
            .is_some_and(|(_, rest)| rest.trim_end_matches('/').eq_ignore_ascii_case(host)),
        (Some(_), None) => false,
        (None, _) => true,
    };
    site_ok && origin_ok
}

/// The middleware of every dashboard route: checks, then runs the page, then adds the
/// security headers and `Server-Timing: app;dur=MS` (the server time of the page).
pub(crate) async fn guard(State(d): State<Dashboard>, mut req: Request, next: Next) -> Response {
    let started = Instant::now();
    let headers = req.headers();
    let who = match d.token.as_deref() {
        Some(token) => match authenticate(token, headers) {
            Some(who) => who,
            None => {
                let mut r = refuse(StatusCode::UNAUTHORIZED, "authentication required");
                r.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Basic realm=\"outbox dashboard\", charset=\"UTF-8\""),
                );
                return with_headers(r, started);
            }
        },
        None => {
            // No token: loopback only, and only under a loopback name (no DNS rebinding).
            let host = headers
                .get(header::HOST)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            if !is_loopback_host(host) {
                return with_headers(
                    refuse(
                        StatusCode::MISDIRECTED_REQUEST,
                        "without a token the dashboard answers only to localhost, 127.0.0.1 or [::1]",
                    ),
                    started,
                );
            }
            "anonymous".to_owned()
        }
    };
    if req.method() != Method::GET && req.method() != Method::HEAD && !same_origin(headers) {
        tracing::warn!(
            origin = ?headers.get(header::ORIGIN),
            sec_fetch_site = ?headers.get("sec-fetch-site"),
            host = ?headers.get(header::HOST),
            "dashboard: cross-site request refused"
        );
        return with_headers(
            refuse(StatusCode::FORBIDDEN, "cross-site request refused"),
            started,
        );
    }
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0);
    req.extensions_mut().insert(Operator { who, peer });
    let response = next.run(req).await;
    with_headers(response, started)
}

fn with_headers(mut response: Response, started: Instant) -> Response {
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    // `same-origin`, not `no-referrer`: under `no-referrer` a browser sends
    // `Origin: null` with the dashboard's own form posts, which the origin check refuses.
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    if let Ok(v) = HeaderValue::from_str(&format!("app;dur={ms:.1}")) {
        h.insert("server-timing", v);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn basic(user_password: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        let encoded = base64::engine::general_purpose::STANDARD.encode(user_password);
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Basic {encoded}")).expect("header"),
        );
        h
    }

    #[test]
    fn tokens_authenticate_as_bearer_or_basic_password() {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer s3cret-token"),
        );
        assert_eq!(authenticate("s3cret-token", &h).as_deref(), Some("token"));
        assert_eq!(authenticate("other", &h), None);
        assert_eq!(
            authenticate("s3cret-token", &basic("alice:s3cret-token")).as_deref(),
            Some("alice")
        );
        assert_eq!(authenticate("s3cret-token", &basic("alice:wrong")), None);
        assert_eq!(authenticate("s3cret-token", &HeaderMap::new()), None);
        // A password holding `:` is split at the first one only.
        assert_eq!(
            authenticate("a:b", &basic("bob:a:b")).as_deref(),
            Some("bob")
        );
    }

    #[test]
    fn only_loopback_names_pass_the_host_check() {
        for ok in [
            "127.0.0.1:9465",
            "localhost:80",
            "LOCALHOST",
            "[::1]:9465",
            "127.1.2.3:1",
        ] {
            assert!(is_loopback_host(ok), "{ok}");
        }
        for bad in [
            "evil.example:9465",
            "10.0.0.1:9465",
            "",
            "127.0.0.1.evil.example",
        ] {
            assert!(!is_loopback_host(bad), "{bad}");
        }
    }

    #[test]
    fn posts_from_other_origins_are_refused() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("127.0.0.1:9465"));
        assert!(same_origin(&h));
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://127.0.0.1:9465"),
        );
        assert!(same_origin(&h));
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://evil.example"),
        );
        assert!(!same_origin(&h));
        h.remove(header::ORIGIN);
        h.insert("sec-fetch-site", HeaderValue::from_static("cross-site"));
        assert!(!same_origin(&h));
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"abc", b"abcd"));
        assert_eq!(new_csrf_token().len(), 64);
        assert_ne!(new_csrf_token(), new_csrf_token());
    }
}
