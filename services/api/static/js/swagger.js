// The API reference (/docs): Swagger UI from static/vendor, no CDN, no inline script.
window.addEventListener('load', () => {
  window.ui = SwaggerUIBundle({url: '/openapi.json', dom_id: '#swagger-ui', deepLinking: true});
});
