//! The chat page at `GET /`: one static HTML file (`chat.html`, its CSS and
//! JavaScript inline) built into the binary with `include_str!`, so a person
//! can try the served model in a browser with no build step and no network.
//!
//! The page only calls this server's own API (`/v1/models`,
//! `/v1/chat/completions`); its Content-Security-Policy forbids every other
//! origin. Its behaviour is tested in a real browser by
//! `tests/python/chat_page_test.py`.

use axum::http::header;
use axum::response::{Html, IntoResponse, Response};

/// The page itself.
const CHAT_HTML: &str = include_str!("chat.html");

/// Inline script and style only; requests to this origin only.
const CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; \
                   style-src 'unsafe-inline'; connect-src 'self'; img-src data:; \
                   base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// `GET /`: the chat page (`text/html`).
pub(crate) async fn chat_page() -> Response {
    (
        [
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Html(CHAT_HTML),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_page_is_html_that_calls_only_this_server() {
        let r = chat_page().await;
        assert_eq!(r.status(), 200);
        let ct = r.headers()[header::CONTENT_TYPE].to_str().unwrap();
        assert!(ct.starts_with("text/html"), "{ct}");
        assert!(r.headers()[header::CONTENT_SECURITY_POLICY]
            .to_str()
            .unwrap()
            .contains("connect-src 'self'"));
        // No CDN or other origin: every URL the page fetches is relative.
        assert!(!CHAT_HTML.contains("http://") && !CHAT_HTML.contains("https://"));
        assert!(CHAT_HTML.contains("/v1/chat/completions") && CHAT_HTML.contains("/v1/models"));
    }
}
