//! The connection, and the failures that end a command with its exit code.

use std::fmt;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use tower_inbox::schema::Schema;

/// Why a command did not do what it was asked, and its exit code.
#[derive(Debug)]
pub enum Failure {
    /// Exit 1: the request is understood and refused (unknown ID, already decided).
    Refused(String),
    /// Exit 2: the command line is wrong.
    Usage(String),
    /// Exit 3: the database cannot be reached or used.
    Database(String),
}

impl Failure {
    pub fn code(&self) -> u8 {
        match self {
            Self::Refused(_) => 1,
            Self::Usage(_) => 2,
            Self::Database(_) => 3,
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Refused(why) | Self::Usage(why) | Self::Database(why) => f.write_str(why),
        }
    }
}

/// The pool and the schema every command works in.
pub struct Database {
    pub pool: PgPool,
    pub schema: Schema,
    target: Target,
}

impl Database {
    /// A database error of `what` as one line naming the server.
    pub fn failure(&self, what: &str, err: impl fmt::Display) -> Failure {
        self.target.failure(what, err)
    }
}

/// The server as errors name it, and the password to keep out of them.
struct Target {
    name: String,
    password: Option<String>,
}

impl Target {
    /// One line naming the server, with the password taken out should the server or the
    /// driver ever echo it.
    fn failure(&self, what: &str, err: impl fmt::Display) -> Failure {
        let mut message = format!("{what} {}: {err}", self.name);
        if let Some(password) = self.password.as_deref().filter(|p| !p.is_empty()) {
            message = message.replace(password, "***");
        }
        Failure::Database(message)
    }
}

/// Connects to the URL (from `origin`, the flag or the variable), within 10 s.
pub async fn connect(url: Option<&str>, origin: &str, schema: &str) -> Result<Database, Failure> {
    let url = url.ok_or_else(|| {
        Failure::Usage("no database: pass --database-url or set DATABASE_URL".to_owned())
    })?;
    let schema =
        Schema::new(schema).map_err(|e| Failure::Usage(format!("--schema {schema:?}: {e}")))?;
    // The URL is not echoed: it may hold the password.
    let options: PgConnectOptions = url.parse().map_err(|_| {
        Failure::Usage(format!(
            "the database URL from {origin} is not a PostgreSQL URL"
        ))
    })?;
    let target = Target {
        name: format!(
            "PostgreSQL at {}:{} (URL from {origin})",
            options.get_host(),
            options.get_port()
        ),
        password: url::password_of(url),
    };
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options.application_name("tower-inbox-cli"))
        .await
        .map_err(|err| target.failure("cannot connect to", err))?;
    Ok(Database {
        pool,
        schema,
        target,
    })
}

mod url {
    /// The password part of `scheme://user:password@host/...`, to keep it out of messages.
    pub fn password_of(url: &str) -> Option<String> {
        let rest = url.split_once("://")?.1;
        let userinfo = rest.split_once('@')?.0;
        let password = userinfo.split_once(':')?.1;
        Some(password.to_owned())
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn the_password_is_found_to_be_hidden() {
            let p = super::password_of;
            assert_eq!(p("postgres://u:s3cret@h:5432/d").as_deref(), Some("s3cret"));
            assert_eq!(p("postgres://u@h/d"), None);
            assert_eq!(p("postgres://h/d"), None);
        }
    }
}
