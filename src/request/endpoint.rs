//! Which of Ollama's and OpenAI's endpoints a request is for.

use http::Method;

/// Endpoints that are forwarded to the node chosen for the request's model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    Chat,
    Generate,
    Embed,
    Embeddings,
    Show,
    OpenAiChat,
    OpenAiCompletions,
    OpenAiEmbeddings,
    /// OpenAI's Responses API (`input`, `instructions`), as Ollama serves it.
    OpenAiResponses,
    /// Anthropic's Messages API (`system`, content blocks), as Ollama serves it.
    AnthropicMessages,
    /// OpenAI's audio transcription: a multipart form, the model in its `model` field.
    Transcriptions,
    /// Pull, push, create, copy, delete and blob uploads, sent to the node a client names.
    Manage,
}

/// What corral does with a request, decided from its method and path alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// Forwarded to the best node for the body's model.
    Model(Endpoint),
    /// `GET /api/tags`: models on disk across the healthy fleet.
    Tags,
    /// `GET /v1/models`: the same, shaped as OpenAI's model list.
    OpenAiModels,
    /// `GET /v1/models/{model}`: one model of that list, or 404.
    OpenAiModel,
    /// `GET /api/status`: answered by corral (cloud use is not routed).
    Status,
    /// `/api/experimental/*`: not served (they act through one node's ollama.com account).
    Experimental,
    /// `GET /api/ps`: models resident across the healthy fleet.
    Ps,
    Version,
    /// `GET` or `HEAD /`: "Ollama is running".
    Root,
    /// Pull, push, create, copy, delete: they change a node, so they need a chosen target.
    Management,
    /// A known path with the wrong method.
    WrongMethod(&'static str),
    NotFound,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/api/chat",
            Endpoint::Generate => "/api/generate",
            Endpoint::Embed => "/api/embed",
            Endpoint::Embeddings => "/api/embeddings",
            Endpoint::Show => "/api/show",
            Endpoint::OpenAiChat => "/v1/chat/completions",
            Endpoint::OpenAiCompletions => "/v1/completions",
            Endpoint::OpenAiEmbeddings => "/v1/embeddings",
            Endpoint::OpenAiResponses => "/v1/responses",
            Endpoint::AnthropicMessages => "/v1/messages",
            Endpoint::Transcriptions => "/v1/audio/transcriptions",
            Endpoint::Manage => "management",
        }
    }

    /// The request class matched against node roles.
    pub fn class(self) -> &'static str {
        match self {
            Endpoint::Chat
            | Endpoint::OpenAiChat
            | Endpoint::OpenAiResponses
            | Endpoint::AnthropicMessages => "chat",
            Endpoint::Transcriptions => "transcribe",
            Endpoint::Generate | Endpoint::OpenAiCompletions => "generate",
            Endpoint::Embed | Endpoint::Embeddings | Endpoint::OpenAiEmbeddings => "embed",
            Endpoint::Show => "show",
            Endpoint::Manage => "manage",
        }
    }

    /// Ollama's own endpoints stream unless told `"stream": false`; OpenAI's only when told
    /// `"stream": true`; embeddings and show never do.
    pub fn streams_by_default(self) -> bool {
        matches!(self, Endpoint::Chat | Endpoint::Generate | Endpoint::Manage)
    }

    pub fn is_openai(self) -> bool {
        matches!(
            self,
            Endpoint::OpenAiChat
                | Endpoint::OpenAiCompletions
                | Endpoint::OpenAiEmbeddings
                | Endpoint::OpenAiResponses
                | Endpoint::Transcriptions
        )
    }

    /// The shape of an error this endpoint's clients parse.
    pub fn error_shape(self) -> ErrorShape {
        match self {
            Endpoint::AnthropicMessages => ErrorShape::Anthropic,
            e if e.is_openai() => ErrorShape::OpenAi,
            _ => ErrorShape::Ollama,
        }
    }

    /// Whether the endpoint generates text, and so uses a slot and its prefix cache.
    pub fn generates(self) -> bool {
        matches!(
            self,
            Endpoint::Chat
                | Endpoint::Generate
                | Endpoint::OpenAiChat
                | Endpoint::OpenAiCompletions
                | Endpoint::OpenAiResponses
                | Endpoint::AnthropicMessages
        )
    }
}

/// How an API spells an error: Ollama's `{"error": "..."}`, OpenAI's
/// `{"error": {"message", "type", "param", "code"}}`, Anthropic's
/// `{"type": "error", "error": {"type", "message"}}` (Ollama's `openai/openai.go` and
/// `anthropic/anthropic.go`, `NewError`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorShape {
    Ollama,
    OpenAi,
    Anthropic,
}

impl ErrorShape {
    /// The error shape of a request's path, for answers given before its body is read.
    pub fn of_path(path: &str) -> ErrorShape {
        match path.trim_end_matches('/') {
            "/v1/messages" => ErrorShape::Anthropic,
            p if p.starts_with("/v1/") => ErrorShape::OpenAi,
            _ => ErrorShape::Ollama,
        }
    }
}

impl Route {
    /// A bounded label for metrics: the endpoint's path, or `other`.
    pub fn label(self) -> &'static str {
        match self {
            Route::Model(e) => e.path(),
            Route::Tags => "/api/tags",
            Route::OpenAiModels => "/v1/models",
            Route::OpenAiModel => "/v1/models/{model}",
            Route::Status => "/api/status",
            Route::Experimental => "/api/experimental",
            Route::Ps => "/api/ps",
            Route::Version => "/api/version",
            Route::Root => "/",
            Route::Management => "management",
            Route::WrongMethod(_) | Route::NotFound => "other",
        }
    }

    pub fn of(method: &Method, path: &str) -> Route {
        let path = path.trim_end_matches('/');
        let endpoint = match path {
            "/api/chat" => Some(Endpoint::Chat),
            "/api/generate" => Some(Endpoint::Generate),
            "/api/embed" => Some(Endpoint::Embed),
            "/api/embeddings" => Some(Endpoint::Embeddings),
            "/api/show" => Some(Endpoint::Show),
            "/v1/chat/completions" => Some(Endpoint::OpenAiChat),
            "/v1/completions" => Some(Endpoint::OpenAiCompletions),
            "/v1/embeddings" => Some(Endpoint::OpenAiEmbeddings),
            "/v1/responses" => Some(Endpoint::OpenAiResponses),
            "/v1/messages" => Some(Endpoint::AnthropicMessages),
            "/v1/audio/transcriptions" => Some(Endpoint::Transcriptions),
            _ => None,
        };
        let is_get = method == Method::GET || method == Method::HEAD;
        if let Some(endpoint) = endpoint {
            return if method == Method::POST {
                Route::Model(endpoint)
            } else {
                Route::WrongMethod("POST")
            };
        }
        let local = match path {
            "" => Route::Root,
            "/api/tags" => Route::Tags,
            "/api/ps" => Route::Ps,
            "/api/version" => Route::Version,
            "/v1/models" => Route::OpenAiModels,
            "/api/status" => Route::Status,
            _ if path.starts_with("/v1/models/") => Route::OpenAiModel,
            _ if path.starts_with("/api/experimental/") => return Route::Experimental,
            "/api/pull" | "/api/push" | "/api/create" | "/api/copy" | "/api/delete" => {
                return Route::Management;
            }
            _ if path.starts_with("/api/blobs/") => return Route::Management,
            _ => return Route::NotFound,
        };
        if is_get {
            local
        } else {
            Route::WrongMethod("GET")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_by_method_and_path() {
        assert_eq!(
            Route::of(&Method::POST, "/api/chat"),
            Route::Model(Endpoint::Chat)
        );
        assert_eq!(
            Route::of(&Method::POST, "/v1/chat/completions"),
            Route::Model(Endpoint::OpenAiChat)
        );
        assert_eq!(
            Route::of(&Method::GET, "/api/chat"),
            Route::WrongMethod("POST")
        );
        assert_eq!(Route::of(&Method::GET, "/"), Route::Root);
        assert_eq!(Route::of(&Method::HEAD, "/"), Route::Root);
        assert_eq!(Route::of(&Method::GET, "/api/tags"), Route::Tags);
        assert_eq!(
            Route::of(&Method::POST, "/api/tags"),
            Route::WrongMethod("GET")
        );
        assert_eq!(Route::of(&Method::DELETE, "/api/delete"), Route::Management);
        assert_eq!(Route::of(&Method::POST, "/api/pull"), Route::Management);
        assert_eq!(Route::of(&Method::GET, "/nope"), Route::NotFound);
    }

    #[test]
    fn routes_of_current_ollama() {
        for (path, endpoint) in [
            ("/v1/responses", Endpoint::OpenAiResponses),
            ("/v1/messages", Endpoint::AnthropicMessages),
            ("/v1/audio/transcriptions", Endpoint::Transcriptions),
        ] {
            assert_eq!(Route::of(&Method::POST, path), Route::Model(endpoint));
        }
        assert_eq!(
            Route::of(&Method::GET, "/v1/models/llama3:8b"),
            Route::OpenAiModel
        );
        assert_eq!(Route::of(&Method::HEAD, "/api/tags"), Route::Tags);
        assert_eq!(Route::of(&Method::HEAD, "/api/version"), Route::Version);
        assert_eq!(Route::of(&Method::GET, "/api/status"), Route::Status);
        assert_eq!(
            Route::of(&Method::POST, "/api/experimental/web_search"),
            Route::Experimental
        );
        assert_eq!(
            Endpoint::AnthropicMessages.error_shape(),
            ErrorShape::Anthropic
        );
        assert_eq!(Endpoint::OpenAiResponses.error_shape(), ErrorShape::OpenAi);
        assert_eq!(Endpoint::Chat.error_shape(), ErrorShape::Ollama);
        assert!(!Endpoint::Transcriptions.generates());
    }

    #[test]
    fn streaming_defaults_differ_by_api() {
        assert!(Endpoint::Chat.streams_by_default());
        assert!(!Endpoint::OpenAiChat.streams_by_default());
        assert!(!Endpoint::Embed.streams_by_default());
    }
}
